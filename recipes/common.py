"""What the large recipes share: DAPO-style GRPO on math with verifiable rewards, and FP8 by hardware.

Each large recipe sets the architecture (so that `python tools/plan.py --recipe NAME` checks its
layout without the checkpoint) and the parallel layout its size needs. For a run, point
model.hf_path at the Hugging Face checkpoint (its config.json then sets the model section; weights
and tokenizer come from it) and data.train_path at a JSONL of {"prompt", "answer"} rows, then
under Slurm (see slurm/):

    srun python train.py --recipe qwen3_235b_a22b_grpo model.hf_path=/ckpt/Qwen3-235B-A22B \\
        data.train_path=/data/math.jsonl
"""

import dataclasses

from megatron_rl.config import (AlgorithmConfig, Config, DataConfig, LoRAConfig, ModelConfig, OptimizerConfig,
                                ParallelConfig, RewardsConfig, RolloutConfig, SchedulerConfig, TrainConfig)


def math_grpo(model: ModelConfig, parallel: ParallelConfig, prompts_per_step: int, max_requests: int,
              kv_cache_gb: float, prompt_tokens: int = 1024, answer_tokens: int = 3072) -> Config:
    """DAPO-style GRPO on math problems: by default 1k-token prompts, 3k-token answers, 8 samples each."""
    seq_length = prompt_tokens + answer_tokens
    return Config(
        model=model,
        parallel=parallel,
        data=DataConfig(task="", train_path="data/math/train.jsonl", seq_length=seq_length, micro_batch_size=1),
        algorithm=AlgorithmConfig(name="grpo", prompts_per_step=prompts_per_step, minibatches=4, clip_low=0.2,
                                  clip_high=0.28, loss_aggregation="token", dynamic_sampling=True),
        rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=answer_tokens, max_sequence_length=seq_length + 128,
                              max_requests=max_requests, kv_cache_gb=kv_cache_gb,
                              block_size_tokens=64 if model.multi_latent_attention else 32),
        rewards=RewardsConfig(fn="math", overlong_buffer=min(512, answer_tokens // 4), workers=8),
        optimizer=OptimizerConfig(lr=1e-6, min_lr=1e-6, weight_decay=0.1, clip_grad=1.0, distributed=True),
        scheduler=SchedulerConfig(warmup_steps=10, decay="constant"),
        train=TrainConfig(max_steps=500, eval_every=25, precision="bf16", recompute="full"),
    )


FP8_BY_GPU = {"h100": "blockwise", "gb200": "mxfp8"}
"""The FP8 scaling each GPU runs best: 128-element blocks on Hopper (CUDA >= 12.9), MXFP8's
32-element blocks on Blackwell."""


def with_fp8(cfg: Config, gpu: str) -> Config:
    """FP8 GEMMs (e4m3 forward, e5m2 gradients) in the scaling `gpu` runs best. Rollouts go through
    the same FP8 modules, so their log-probabilities differ more from training's: truncated
    importance weights correct for it."""
    cfg.fp8.format, cfg.fp8.recipe = "hybrid", FP8_BY_GPU[gpu]
    cfg.algorithm.mismatch_correction = "token_truncate"
    return cfg


def on_gb200(cfg: Config, prompts_per_step: int = 0, **parallel) -> Config:
    """The GB200 (NVL72 trays of 4 GPUs, 186 GB each) variant of an H100 recipe: fewer, larger GPUs
    (`parallel` changes the layout; fewer data-parallel ranks may take fewer prompts a step), MXFP8."""
    cfg.parallel = dataclasses.replace(cfg.parallel, **parallel)  # a misspelled field is a TypeError
    cfg.algorithm.prompts_per_step = prompts_per_step or cfg.algorithm.prompts_per_step
    return with_fp8(cfg, "gb200")


def with_lora(cfg: Config, rank: int = 64, alpha: float = 128, lr: float = 1e-5, min_lr: float | None = None) -> Config:
    """The recipe with LoRA adapters on every attention and MLP projection, the base frozen: LoRA takes about
    10x the full model's learning rate."""
    cfg.lora = LoRAConfig(rank=rank, alpha=alpha)
    cfg.optimizer.lr, cfg.optimizer.min_lr = lr, lr if min_lr is None else min_lr
    return cfg
