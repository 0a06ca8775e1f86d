"""Nemotron: the Nemotron-H hybrids NeMo RL post-trains (Mamba-2 + attention + MoE; Nemotron 3 Nano
30B-A3B as `nemotron_grpo`, Nemotron-H 8B) and the dense Nemotron-4-340B, GRPO on math
(recipes/common.py says how to run them).

Nemotron 3 Nano has 2 key/value heads, so tensor parallelism stops at 2: its layouts grow with
expert and pipeline parallelism. As NeMo RL runs it, the router is frozen and kept in fp32, with
no auxiliary loss (replayed routing in rollouts and training, algorithm.router_replay).
"""

from megatron_rl.config import Config, ModelConfig, ParallelConfig

from . import register
from .common import math_grpo, on_gb200, with_lora

NANO3_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def _hybrid(**fields) -> ModelConfig:
    return ModelConfig(family="nemotron_h", norm_epsilon=1e-5, activation="squared_relu", vocab_size=131072,
                       mamba_head_dim=64, mamba_num_groups=8, mamba_state_dim=128, mamba_conv_kernel=4,
                       mamba_chunk_size=128, head_dim=128, **fields)


def nemotron3_nano() -> ModelConfig:
    """Nemotron 3 Nano 30B-A3B: 52 layers (23 Mamba-2, 23 MoE, 6 attention), 128 experts top-6 with a
    shared expert, sigmoid routing with expert bias and scaling 2.5."""
    return _hybrid(num_layers=52, hidden_size=2688, ffn_hidden_size=1856, num_attention_heads=32, num_query_groups=2,
                   max_position_embeddings=262144, hybrid_pattern=NANO3_PATTERN, mamba_num_heads=64, num_experts=128,
                   moe_ffn_hidden_size=1856, moe_shared_ffn_hidden_size=3712, moe_topk=6, moe_score_function="sigmoid",
                   moe_expert_bias=True, moe_topk_scaling_factor=2.5, moe_router_dtype="fp32", moe_router_frozen=True,
                   moe_aux_loss_type="none", moe_dispatcher="alltoall")


@register
def nemotron_grpo() -> Config:
    """Nemotron 3 Nano 30B-A3B (hybrid Mamba-2 + MoE), GRPO on math: 2 nodes x 8 H100 (TP2 + SP, EP8,
    DP8), bf16, router frozen and replayed.

    Planner: fits, 67.9 of 80 GB on the fullest rank.
    """
    cfg = math_grpo(nemotron3_nano(), ParallelConfig(tp=2, sp=True, ep=8, etp=1, dp=8), prompts_per_step=64,
                    max_requests=64, kv_cache_gb=8)
    cfg.algorithm.router_replay = True
    return cfg


@register(gpu="gb200")
def nemotron_grpo_gb200() -> Config:
    """Nemotron 3 Nano 30B-A3B, GRPO on math: 2 GB200 trays x 4 GPUs (TP2 + SP, EP8, DP4), MXFP8.

    Planner: fits, 91.5 of 186 GB on the fullest rank.
    """
    return on_gb200(nemotron_grpo(), prompts_per_step=32, dp=4)


@register
def nemotron_h_8b_grpo() -> Config:
    """Nemotron-H 8B (hybrid: 24 Mamba-2, 4 attention, 24 MLP layers), GRPO on math: one node of 8 H100
    (TP2 + SP, DP4), bf16.

    Planner: fits, 52.4 of 80 GB on the fullest rank.
    """
    model = _hybrid(num_layers=52, hidden_size=4096, ffn_hidden_size=21504, num_attention_heads=32, num_query_groups=8,
                    max_position_embeddings=8192, hybrid_pattern=NEMOTRON_H_8B_PATTERN, mamba_num_heads=128)
    return math_grpo(model, ParallelConfig(tp=2, sp=True, dp=4), prompts_per_step=32, max_requests=64, kv_cache_gb=8)


@register
def nemotron4_340b_grpo() -> Config:
    """Nemotron-4-340B (dense; LayerNorm1P, squared ReLU, partial rotary), GRPO on math: 24 nodes x 8
    H100 (TP8 + SP, PP12, DP2), bf16.

    GB200: 24 x 4-GPU trays: parallel.pp=6 parallel.dp=2 with --world-size 96.
    Planner: fits, 60.1 of 80 GB on the fullest rank.
    """
    model = ModelConfig(family="nemotron", num_layers=96, hidden_size=18432, ffn_hidden_size=73728,
                        num_attention_heads=96, num_query_groups=8, head_dim=192, vocab_size=256000,
                        normalization="LayerNorm", zero_centered_gamma=True, activation="squared_relu",
                        rotary_percent=0.5, norm_epsilon=1e-5, max_position_embeddings=4096)
    return math_grpo(model, ParallelConfig(tp=8, sp=True, pp=12, dp=2), prompts_per_step=32, max_requests=32,
                     kv_cache_gb=4)


@register
def nemotron4_340b_grpo_lora() -> Config:
    """nemotron4_340b_grpo with LoRA (rank 64 on every attention and MLP projection) on a sixth of its GPUs:
    4 nodes x 8 H100 (TP8 + SP, PP4, DP1). Only the adapters (1.83B parameters) have gradients and Adam
    state, and with a KL penalty the reference is the policy with its adapters off.

    Planner: fits, 34.5 of 80 GB on the fullest rank.
    """
    cfg = nemotron4_340b_grpo()
    cfg.parallel.pp, cfg.parallel.dp = 4, 1
    return with_lora(cfg)
