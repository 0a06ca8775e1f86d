"""Mixtral: Mixtral-8x7B(-Instruct), GRPO on math (recipes/common.py says how to run it)."""

from megatron_rl.config import Config, ModelConfig, ParallelConfig

from . import register
from .common import math_grpo, with_lora


@register
def mixtral_8x7b_grpo() -> Config:
    """Mixtral-8x7B(-Instruct) (46.7B, 8 experts, top-2), GRPO on math: 2 nodes x 8 H100 (TP2 + SP,
    EP8 with experts split over TP2, DP8), bf16.

    Planner: fits, 72.0 of 80 GB on the fullest rank.
    """
    model = ModelConfig(family="mixtral", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                        num_attention_heads=32, num_query_groups=8, head_dim=128, vocab_size=32000, max_position_embeddings=32768,
                        rotary_base=1e6, norm_epsilon=1e-5, num_experts=8, moe_ffn_hidden_size=14336, moe_topk=2,
                        moe_dispatcher="alltoall")
    return math_grpo(model, ParallelConfig(tp=2, sp=True, ep=8, etp=2, dp=8), prompts_per_step=64, max_requests=32,
                     kv_cache_gb=8)


@register
def mixtral_8x7b_grpo_lora() -> Config:
    """mixtral_8x7b_grpo with LoRA (rank 64 on attention: 0.05B parameters; the experts keep none) on a
    quarter of its GPUs: 4 H100 (TP2 + SP, EP2 with experts split over TP2, DP2). Nothing but the adapters
    has gradients or Adam state; the full model on 8 H100s would need 123.9 GB on its fullest rank.

    Planner: fits, 39.7 of 80 GB on the fullest rank.
    """
    cfg = mixtral_8x7b_grpo()
    cfg.parallel.ep, cfg.parallel.dp = 2, 2
    return with_lora(cfg)
