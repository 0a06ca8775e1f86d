"""Qwen2 (qkv bias), Qwen3 (q/k norm) and Qwen3-MoE (routed experts, softmax router)."""

from megatron_rl.config import ConfigError, ModelConfig

from .hf_common import (LAYER, attention_rules, base_from_hf, base_to_hf, embedding_rules, fused_expert_rules,
                        layer_norm_rules, mlp_rules, require)
from .mapping import Rule

ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def from_hf(hf: dict) -> ModelConfig:
    arch = hf["architectures"][0]
    require(hf, "hidden_act", ("silu",), "qwen")
    if hf.get("use_sliding_window"):
        raise ConfigError("config.json sets use_sliding_window=true, which the qwen converter does not support.")
    extra = dict(qkv_bias=True) if arch == "Qwen2ForCausalLM" else dict(
        qk_layernorm=True, qkv_bias=bool(hf.get("attention_bias", False)))
    if arch == "Qwen3MoeForCausalLM":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ConfigError("config.json mixes dense and MoE layers (mlp_only_layers / decoder_sparse_step), "
                              "which the qwen converter does not support.")
        extra.update(num_experts=hf.get("num_experts") or hf["num_local_experts"],
                     moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_topk=hf["num_experts_per_tok"],
                     # softmax over all experts then top-k; renormalized over the top-k iff norm_topk_prob
                     moe_pre_softmax=not hf.get("norm_topk_prob", False))
    return ModelConfig(family="qwen", **base_from_hf(hf, **extra))


def to_hf(m: ModelConfig) -> dict:
    import transformers

    if m.activation != "swiglu" or m.normalization != "RMSNorm" or m.sliding_window or m.moe_shared_ffn_hidden_size:
        raise ConfigError("this model does not fit a Qwen2/Qwen3/Qwen3-MoE config (activation, norm, sliding "
                          "window or shared experts); pick the family that has them.")
    common = dict(**base_to_hf(m), rms_norm_eps=m.norm_epsilon, hidden_act="silu")
    if m.num_experts:
        arch, cls = "Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig
        common.update(num_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_hidden_size,
                      num_experts_per_tok=m.moe_topk, norm_topk_prob=not m.moe_pre_softmax,
                      attention_bias=m.qkv_bias)
    elif m.qk_layernorm:
        arch, cls = "Qwen3ForCausalLM", transformers.Qwen3Config
        common.update(attention_bias=m.qkv_bias)
    elif m.qkv_bias:
        arch, cls = "Qwen2ForCausalLM", transformers.Qwen2Config
    else:
        raise ConfigError("a qwen model has q/k norm (Qwen3) or qkv bias (Qwen2); set model.family=llama otherwise.")
    return {**cls(**common).to_dict(), "architectures": [arch]}


def weight_rules(m: ModelConfig):
    rules = [*embedding_rules(m), *layer_norm_rules(m), *attention_rules(m)]
    if not m.num_experts:
        return rules + mlp_rules(f"{LAYER}.mlp", "model.layers.{L}.mlp")
    return [*rules, Rule(f"{LAYER}.mlp.router.weight", ("model.layers.{L}.mlp.gate.weight",)),
            *mlp_rules(f"{LAYER}.mlp.experts.{{E}}", "model.layers.{L}.mlp.experts.{E}"),
            *fused_expert_rules("model.layers.{L}.mlp.experts")]
