"""DeepSeek-V3 (671B, multi-latent attention, 256 experts), GRPO on math (recipes/common.py says how
to run them). Rollouts read each token's compressed latent from a paged cache and up-project it
with the training module's own layer (model_providers/latent_attention.py).
"""

from megatron_rl.config import Config, ModelConfig, ParallelConfig

from . import register
from .common import math_grpo, on_gb200, with_fp8


@register
def deepseek_v3_grpo() -> Config:
    """DeepSeek-V3 (671B, MLA, 256 experts), GRPO on math: 32 nodes x 8 H100 (TP8 + SP, PP8 with
    7/8/6 layers, EP32, DP4), blockwise FP8.

    Planner: fits, 67.1 of 80 GB on the fullest rank.
    """
    model = ModelConfig(
        family="deepseek", num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
        head_dim=128, vocab_size=129280, max_position_embeddings=163840, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_head_dim=64,
        v_head_dim=128, rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_position=4096,
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0, num_experts=256, moe_ffn_hidden_size=2048,
        moe_shared_ffn_hidden_size=2048, moe_first_dense_layers=3, moe_topk=8, moe_score_function="sigmoid",
        moe_expert_bias=True, moe_num_groups=8, moe_group_topk=4, moe_topk_scaling_factor=2.5,
        moe_dispatcher="alltoall")
    cfg = math_grpo(model, ParallelConfig(tp=8, sp=True, pp=8, first_stage_layers=7, last_stage_layers=6, ep=32,
                                          etp=1, dp=4),
                    prompts_per_step=32, max_requests=16, kv_cache_gb=8)
    return with_fp8(cfg, "h100")


@register(gpu="gb200")
def deepseek_v3_grpo_gb200() -> Config:
    """DeepSeek-V3, GRPO on math: 32 GB200 trays x 4 GPUs, two NVL72 racks (TP4 + SP, PP8 with 7/8/6
    layers, EP16, DP4), MXFP8.

    Planner: fits, 120.4 of 186 GB on the fullest rank.
    """
    return on_gb200(deepseek_v3_grpo(), tp=4, ep=16)
