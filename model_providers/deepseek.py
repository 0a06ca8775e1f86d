"""DeepSeek-V3: multi-latent attention, sigmoid router with expert bias and group-limited top-k,
shared experts, the first layers dense. Multi-token prediction (MTP) layers are not converted."""

import re

from megatron_rl.config import ConfigError, ModelConfig

from .hf_common import (LAYER, base_from_hf, base_to_hf, embedding_rules, fused_expert_rules, layer_norm_rules,
                        mlp_rules, require)
from .mapping import Rule

ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def from_hf(hf: dict) -> ModelConfig:
    require(hf, "hidden_act", ("silu",), "deepseek")
    require(hf, "norm_topk_prob", (True,), "deepseek")  # megatron's sigmoid router renormalizes top-k
    require(hf, "rope_interleave", (True, None), "deepseek")
    require(hf, "attention_bias", (False, None), "deepseek")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError("config.json asks for a router other than DeepSeek-V3's (sigmoid scores, "
                          "noaux_tc top-k); the deepseek converter supports only that one.")
    return ModelConfig(family="deepseek", **base_from_hf(
        hf, head_dim=hf["v_head_dim"], multi_latent_attention=True, qk_layernorm=True,
        q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        num_experts=hf["n_routed_experts"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_ffn_hidden_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
        moe_first_dense_layers=hf.get("first_k_dense_replace", 0), moe_topk=hf["num_experts_per_tok"],
        moe_score_function="sigmoid", moe_expert_bias=True, moe_num_groups=hf.get("n_group") or 0,
        moe_group_topk=hf.get("topk_group") or 0, moe_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0))))


def to_hf(m: ModelConfig) -> dict:
    from transformers import DeepseekV3Config

    if not (m.multi_latent_attention and m.num_experts and m.moe_score_function == "sigmoid"):
        raise ConfigError("a DeepSeek-V3 config needs multi-latent attention and a sigmoid-scored MoE.")
    shared = m.moe_shared_ffn_hidden_size // m.moe_ffn_hidden_size
    return {**DeepseekV3Config(
        **base_to_hf(m), rms_norm_eps=m.norm_epsilon, q_lora_rank=m.q_lora_rank or None,
        kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_head_dim,
        v_head_dim=m.v_head_dim, n_routed_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_hidden_size,
        n_shared_experts=shared, first_k_dense_replace=m.moe_first_dense_layers, num_experts_per_tok=m.moe_topk,
        n_group=m.moe_num_groups or 1, topk_group=m.moe_group_topk or 1, norm_topk_prob=True,
        routed_scaling_factor=m.moe_topk_scaling_factor, num_nextn_predict_layers=0).to_dict(),
        "architectures": ["DeepseekV3ForCausalLM"]}


def skipped(name: str, m: ModelConfig) -> str | None:
    """Why an HF tensor is left out on import, or None: MTP layers follow the decoder layers."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer and int(layer.group(1)) >= m.num_layers:
        return "multi-token prediction (MTP) layers are not converted"
    return None


def weight_rules(m: ModelConfig):
    att, hf = f"{LAYER}.self_attention", "model.layers.{L}.self_attn"
    if m.q_lora_rank:
        query = [Rule(f"{att}.linear_q_down_proj.weight", (f"{hf}.q_a_proj.weight",)),
                 Rule(f"{att}.q_layernorm.weight", (f"{hf}.q_a_layernorm.weight",)),
                 Rule(f"{att}.linear_q_up_proj.weight", (f"{hf}.q_b_proj.weight",))]
    else:
        query = [Rule(f"{att}.linear_q_proj.weight", (f"{hf}.q_proj.weight",))]
    moe = "model.layers.{L}.mlp"
    return [*embedding_rules(m), *layer_norm_rules(m), *query,
            Rule(f"{att}.linear_kv_down_proj.weight", (f"{hf}.kv_a_proj_with_mqa.weight",)),
            Rule(f"{att}.kv_layernorm.weight", (f"{hf}.kv_a_layernorm.weight",)),
            Rule(f"{att}.linear_kv_up_proj.weight", (f"{hf}.kv_b_proj.weight",)),
            Rule(f"{att}.linear_proj.weight", (f"{hf}.o_proj.weight",)),
            *mlp_rules(f"{LAYER}.mlp", moe),  # the first, dense layers
            Rule(f"{LAYER}.mlp.router.weight", (f"{moe}.gate.weight",)),
            Rule(f"{LAYER}.mlp.router.expert_bias", (f"{moe}.gate.e_score_correction_bias",)),
            *mlp_rules(f"{LAYER}.mlp.shared_experts", f"{moe}.shared_experts"),
            *mlp_rules(f"{LAYER}.mlp.experts.{{E}}", f"{moe}.experts.{{E}}"),
            *fused_expert_rules(f"{moe}.experts")]
