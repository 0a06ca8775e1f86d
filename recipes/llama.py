"""Llama: Llama-3.2-1B-Instruct on one GPU, the usual quick start (SFT, then GRPO on math).

Point model.hf_path at the Hugging Face checkpoint (its config.json sets the model section; weights
and tokenizer come from it) and data.train_path at your JSONL:

    python train.py --recipe llama32_1b_sft model.hf_path=/ckpt/Llama-3.2-1B-Instruct \\
        data.train_path=/data/chat.jsonl                 # {"messages": [...]} or {"prompt", "response"} rows
    python train.py --recipe llama32_1b_grpo model.hf_path=/ckpt/Llama-3.2-1B-Instruct \\
        data.train_path=/data/gsm8k.jsonl                # {"prompt", "answer"} rows
"""

from megatron_rl.config import Config, DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, SchedulerConfig, TrainConfig

from . import register
from .common import math_grpo


def llama32_1b() -> ModelConfig:
    """Llama-3.2-1B(-Instruct): 16 layers, GQA 32/8, tied embeddings, llama3 rope scaling."""
    return ModelConfig(family="llama", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                       num_query_groups=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                       norm_epsilon=1e-5, tie_embeddings=True, rotary_base=500000.0, rope_scaling="llama3",
                       rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                       rope_original_max_position=8192)


@register
def llama32_1b_sft() -> Config:
    """Llama-3.2-1B-Instruct, SFT on chat data: one GPU (H100 or A100 80GB), bf16, 2k-token sequences.

    Planner: fits, 47.6 of 80 GB.
    """
    return Config(
        model=llama32_1b(),
        parallel=ParallelConfig(),
        data=DataConfig(task="", train_path="data/sft/train.jsonl", seq_length=2048, micro_batch_size=4,
                        global_batch_size=64),
        optimizer=OptimizerConfig(lr=1e-5, min_lr=1e-6, weight_decay=0.01, clip_grad=1.0),
        scheduler=SchedulerConfig(warmup_steps=50, decay="cosine"),
        train=TrainConfig(max_steps=1000, eval_every=100, precision="bf16"),
    )


@register
def llama32_1b_grpo() -> Config:
    """Llama-3.2-1B-Instruct, GRPO on math (GSM8K-style problems, math-verify reward): one GPU (H100 or
    A100 80GB), bf16; 32 prompts x 16 samples a step, answers up to 768 tokens.

    Planner: fits, 54.6 of 80 GB.
    """
    cfg = math_grpo(llama32_1b(), ParallelConfig(), prompts_per_step=32, max_requests=512, kv_cache_gb=4,
                    prompt_tokens=256, answer_tokens=768)
    cfg.rollout.n = 16
    cfg.data.micro_batch_size = 4
    cfg.optimizer.distributed = False  # one GPU: nothing to shard over
    cfg.train.recompute = "none"
    cfg.train.eval_every = 10
    return cfg
