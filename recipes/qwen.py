"""Qwen: Qwen2.5 (dense, biased q/k/v) and Qwen3-MoE, GRPO on math (recipes/common.py says how to run them)."""

import dataclasses

from megatron_rl.config import Config, ModelConfig, ParallelConfig

from . import register
from .common import math_grpo, on_gb200, with_fp8, with_lora


def _qwen3_moe(layers, hidden, heads, experts_ffn) -> ModelConfig:
    return ModelConfig(family="qwen", num_layers=layers, hidden_size=hidden, ffn_hidden_size=3 * hidden,
                       num_attention_heads=heads, num_query_groups=4, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, qk_layernorm=True, rotary_base=1e6, num_experts=128,
                       moe_ffn_hidden_size=experts_ffn, moe_topk=8, moe_dispatcher="alltoall")


@register
def qwen3_30b_a3b_grpo() -> Config:
    """Qwen3-30B-A3B, GRPO on math: 2 nodes x 8 H100 (TP2 + SP, EP8, DP8), bf16.

    Planner: fits, 69.4 of 80 GB on the fullest rank.
    """
    return math_grpo(_qwen3_moe(48, 2048, 32, 768), ParallelConfig(tp=2, sp=True, ep=8, etp=1, dp=8),
                     prompts_per_step=64, max_requests=64, kv_cache_gb=8)


@register
def qwen3_30b_a3b_grpo_async() -> Config:
    """Qwen3-30B-A3B, GRPO on math one step off-policy, in the shape of NeMo RL's async run: 4 nodes x 8 H100,
    16 of them generating (parallel.rollout_ranks=16: 8 copies of the policy at TP2, experts over EP8) while
    the other 16 train in qwen3_30b_a3b_grpo's layout (TP2 + SP, EP8, DP8); rollouts at most one step old
    (algorithm.max_staleness=1), AReaL's decoupled objective; bf16.

    Planner: fits, 56.1 of 80 GB on the fullest rank (a training rank; a generation rank needs 53.1: weights
    5.2, KV cache 42.9).
    """
    cfg = qwen3_30b_a3b_grpo()
    cfg.parallel = dataclasses.replace(cfg.parallel, rollout_ranks=16, rollout_tp=2, rollout_ep=8)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, max_staleness=1, off_policy="decoupled")
    cfg.rollout.kv_cache_gb = 40  # a generation rank holds no optimizer state: room for a large cache
    return cfg


@register(gpu="gb200")
def qwen3_30b_a3b_grpo_gb200() -> Config:
    """Qwen3-30B-A3B, GRPO on math: 2 GB200 trays x 4 GPUs (TP2 + SP, EP8, DP4), MXFP8.

    Planner: fits, 92.3 of 186 GB on the fullest rank.
    """
    return on_gb200(qwen3_30b_a3b_grpo(), prompts_per_step=32, dp=4)


@register
def qwen3_235b_a22b_grpo() -> Config:
    """Qwen3-235B-A22B, GRPO on math: 16 nodes x 8 H100 (TP4 + SP, PP8 with 11/12/11 layers, EP8,
    DP4), blockwise FP8.

    Planner: fits, 59.9 of 80 GB on the fullest rank.
    """
    cfg = math_grpo(_qwen3_moe(94, 4096, 64, 1536),
                    ParallelConfig(tp=4, sp=True, pp=8, first_stage_layers=11, last_stage_layers=11, ep=8, etp=1,
                                   dp=4),
                    prompts_per_step=64, max_requests=32, kv_cache_gb=8)
    return with_fp8(cfg, "h100")


@register(gpu="gb200")
def qwen3_235b_a22b_grpo_gb200() -> Config:
    """Qwen3-235B-A22B, GRPO on math: 16 GB200 trays x 4 GPUs (TP4 + SP, PP4 with 23/24/23 layers,
    EP8, DP4), MXFP8.

    Planner: fits, 105.3 of 186 GB on the fullest rank.
    """
    return on_gb200(qwen3_235b_a22b_grpo(), pp=4, first_stage_layers=23, last_stage_layers=23)


@register(gpu="a100")
def qwen25_32b_grpo() -> Config:
    """Qwen2.5-32B(-Instruct), GRPO on math with 16k-token sequences: one node of 8 A100 80GB (TP8 + SP,
    DP1), bf16 with bf16 Adam moments (optimizer.state_dtype=bf16).

    At TP8 and DP1 nothing shards the optimizer state over data-parallel ranks, and fp32 Adam
    state (12 bytes per parameter) alone is 49 GB per GPU: the planner finds it does not fit, and
    that megatron's precision-aware optimizer (6 bytes per parameter) makes it fit; CPU offload
    (optimizer.cpu_offload=1) fits too, at the cost of a host-side update.

    Planner: fits, 66.0 of 80 GB on the fullest rank.
    """
    model = ModelConfig(family="qwen", num_layers=64, hidden_size=5120, ffn_hidden_size=27648,
                        num_attention_heads=40, num_query_groups=8, head_dim=128, vocab_size=152064,
                        max_position_embeddings=32768, qkv_bias=True, rotary_base=1e6, norm_epsilon=1e-6)
    cfg = math_grpo(model, ParallelConfig(tp=8, sp=True, dp=1), prompts_per_step=8, max_requests=16, kv_cache_gb=8,
                    prompt_tokens=1024, answer_tokens=15360)
    cfg.algorithm.minibatches = 2
    cfg.optimizer.state_dtype = "bf16"
    return cfg


@register(gpu="a100")
def qwen25_32b_grpo_lora() -> Config:
    """qwen25_32b_grpo with LoRA (rank 64 on every attention and MLP projection) on half its GPUs: 4 A100
    80GB (TP4 + SP). The base is frozen, so only the adapters (0.54B parameters) have gradients and Adam
    state; with a KL penalty the reference is the policy with its adapters off, no second copy (the full
    model at TP4 would need 176.1 GB on its fullest rank, 192.5 GB with a reference; LoRA 47.4 GB either way).

    Planner: fits, 47.4 of 80 GB on the fullest rank.
    """
    cfg = qwen25_32b_grpo()
    cfg.parallel.tp = 4
    cfg.optimizer.state_dtype = "fp32"
    return with_lora(cfg)
