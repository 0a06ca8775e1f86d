"""Tiny models on the built-in arithmetic task: fast on a 2-core CPU, used by the demo and tests."""

from megatron_rl.config import (Config, DataConfig, ModelConfig, OptimizerConfig, SchedulerConfig,
                                TrainConfig)

from . import register


def tiny_model() -> ModelConfig:
    return ModelConfig(family="llama", num_layers=2, hidden_size=128, ffn_hidden_size=512,
                       num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


@register
def tiny_sft() -> Config:
    """SFT of a 0.4M-parameter Llama-style model from scratch on 2-digit addition."""
    return Config(
        model=tiny_model(),
        data=DataConfig(task="arithmetic", digits=2, seq_length=16, micro_batch_size=32,
                        global_batch_size=64, num_train=50000, num_val=512),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, weight_decay=0.0, clip_grad=1.0),
        scheduler=SchedulerConfig(warmup_steps=50, decay="cosine"),
        train=TrainConfig(max_steps=800, eval_every=200),
    )
