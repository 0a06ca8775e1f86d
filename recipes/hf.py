"""Any Hugging Face causal LM: SFT, GRPO and DPO with settings for a real model on whatever machine runs it.

    python train.py --recipe hf_sft model.hf_path=/models/Llama-3.2-1B data.task= data.train_path=sft.jsonl
    python train.py --recipe hf_grpo model.hf_path=/models/Qwen3-0.6B data.task= data.train_path=math.jsonl
    python train.py --recipe hf_grpo model.hf_path=runs/hf_sft/hf      # a run's export

The model's config.json sets the architecture and its tokenizer is used; without data.train_path the
built-in arithmetic task (2-digit sums) runs, so a model can be tried at once. Unlike the tiny recipes
(one thread, no packing, shapes for a 0.4M-parameter model), these use every core and pack sequences;
data.seq_length (and the rollout lengths and packing budget with it) is lowered to the model's
max_position_embeddings where that is shorter, with a line saying so.
"""

from megatron_rl.config import (AlgorithmConfig, CheckpointConfig, Config, DataConfig, OptimizerConfig, RewardsConfig,
                                RolloutConfig, SchedulerConfig, TrainConfig)

from . import register

SEQ_LENGTH, COMPLETION = 512, 256


def _hf(name: str, lr: float, **sections) -> Config:
    """Every core (train.threads=0), packed microbatches of 8 sequences' worth of tokens, arithmetic by default."""
    data = DataConfig(task="arithmetic", digits=2, num_train=20000, num_val=256, seq_length=SEQ_LENGTH,
                      micro_batch_size=8, global_batch_size=64, max_tokens_per_microbatch=8 * SEQ_LENGTH)
    return Config(data=data, algorithm=AlgorithmConfig(name=name),
                  optimizer=OptimizerConfig(lr=lr, min_lr=lr / 10, weight_decay=0.01, clip_grad=1.0),
                  scheduler=SchedulerConfig(warmup_steps=10, decay="cosine"),
                  train=TrainConfig(max_steps=500, eval_every=50, threads=0),
                  checkpoint=CheckpointConfig(save_every=100, export_hf=True), **sections)


@register(needs=("model.hf_path",))
def hf_sft() -> Config:
    """SFT of any Hugging Face causal LM (model.hf_path): all cores, packing, lr 1e-5 cosine, 500 steps."""
    return _hf("sft", 1e-5)


@register(needs=("model.hf_path",))
def hf_grpo() -> Config:
    """GRPO of any Hugging Face causal LM (model.hf_path) with 2026's defaults: token-mean loss, clip-higher
    (0.2/0.28), no KL and no reference, truncated importance weights for the rollout/training mismatch."""
    cfg = _hf("grpo", 1e-6)
    cfg.algorithm = AlgorithmConfig(name="grpo", prompts_per_step=32, minibatches=4, clip_low=0.2, clip_high=0.28,
                                    loss_aggregation="token", kl_coef=0.0, mismatch_correction="token_truncate")
    cfg.rollout = RolloutConfig(n=8, temperature=1.0, max_new_tokens=COMPLETION, max_sequence_length=SEQ_LENGTH + 1,
                                max_requests=256)
    cfg.rewards = RewardsConfig(fn="exact_match")
    cfg.scheduler = SchedulerConfig(warmup_steps=0, decay="constant")
    cfg.train.eval_every = 25
    return cfg


@register(needs=("model.hf_path",))
def hf_dpo() -> Config:
    """DPO of any Hugging Face causal LM (model.hf_path): sigmoid loss, beta 0.1, lr 5e-7, packed pairs."""
    cfg = _hf("dpo", 5e-7)
    cfg.data.max_tokens_per_microbatch = 16 * SEQ_LENGTH  # a pair is two sequences
    return cfg
