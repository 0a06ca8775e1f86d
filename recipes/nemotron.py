"""Nemotron: Nemotron-4-340B (dense; LayerNorm1P, squared ReLU, partial rotary), GRPO on math
(recipes/common.py says how to run it)."""

from megatron_rl.config import Config, ModelConfig, ParallelConfig

from . import register
from .common import math_grpo


@register
def nemotron_grpo() -> Config:
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
