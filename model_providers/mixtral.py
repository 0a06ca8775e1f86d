"""Mixtral: Mistral attention with a top-k softmax router over SwiGLU experts."""

from megatron_rl.config import ConfigError, ModelConfig

from .hf_common import (LAYER, attention_rules, base_from_hf, base_to_hf, embedding_rules, fused_expert_rules,
                        layer_norm_rules, mlp_rules, require)
from .mapping import Rule

ARCHITECTURES = ("MixtralForCausalLM",)


def from_hf(hf: dict) -> ModelConfig:
    require(hf, "hidden_act", ("silu",), "mixtral")
    if hf.get("router_jitter_noise"):
        raise ConfigError("config.json sets router_jitter_noise, which the mixtral converter does not support; set it to 0.")
    return ModelConfig(family="mixtral", **base_from_hf(
        hf, sliding_window=hf.get("sliding_window") or 0, num_experts=hf["num_local_experts"],
        moe_ffn_hidden_size=hf["intermediate_size"], moe_topk=hf["num_experts_per_tok"],
        moe_aux_loss_coeff=0.0))


def to_hf(m: ModelConfig) -> dict:
    from transformers import MixtralConfig

    if not m.num_experts or m.moe_pre_softmax or m.qk_layernorm or m.qkv_bias or m.moe_shared_ffn_hidden_size:
        raise ConfigError("this model does not fit a Mixtral config (needs experts with a top-k softmax router, "
                          "no q/k norm, qkv bias or shared experts).")
    common = {**base_to_hf(m), "intermediate_size": m.moe_ffn_hidden_size}
    return {**MixtralConfig(**common, rms_norm_eps=m.norm_epsilon, num_local_experts=m.num_experts,
                            num_experts_per_tok=m.moe_topk, sliding_window=m.sliding_window or None).to_dict(),
            "architectures": ["MixtralForCausalLM"]}


def weight_rules(m: ModelConfig):
    hub = "model.layers.{L}.block_sparse_moe"
    return [*embedding_rules(m), *layer_norm_rules(m), *attention_rules(m),
            Rule(f"{LAYER}.mlp.router.weight", (f"{hub}.gate.weight",)),
            *mlp_rules(f"{LAYER}.mlp.experts.{{E}}", f"{hub}.experts.{{E}}", names=("w1", "w3", "w2")),
            # transformers 5's fused layout also renames the block to `mlp`
            Rule(f"{LAYER}.mlp.router.weight", ("model.layers.{L}.mlp.gate.weight",)),
            *fused_expert_rules("model.layers.{L}.mlp.experts")]
