"""Nemotron (transformers' NemotronForCausalLM): LayerNorm with zero-centered gamma (LayerNorm1P),
squared-ReLU MLP without gate, partial rotary embeddings."""

from megatron_rl.config import ConfigError, ModelConfig

from .hf_common import attention_rules, base_from_hf, base_to_hf, embedding_rules, layer_norm_rules, mlp_rules, require

ARCHITECTURES = ("NemotronForCausalLM",)


def from_hf(hf: dict) -> ModelConfig:
    require(hf, "hidden_act", ("relu2",), "nemotron")
    for key in ("attention_bias", "mlp_bias"):
        require(hf, key, (False, None), "nemotron")
    return ModelConfig(family="nemotron", **base_from_hf(
        hf, normalization="LayerNorm", zero_centered_gamma=True, activation="squared_relu"))


def to_hf(m: ModelConfig) -> dict:
    from transformers import NemotronConfig

    if m.normalization != "LayerNorm" or not m.zero_centered_gamma or m.activation != "squared_relu" \
            or m.num_experts or m.qk_layernorm or m.qkv_bias:
        raise ConfigError("this model does not fit a Nemotron config (LayerNorm1P, squared ReLU, dense, "
                          "no q/k norm or qkv bias).")
    return {**NemotronConfig(**base_to_hf(m), norm_eps=m.norm_epsilon, hidden_act="relu2").to_dict(),
            "architectures": ["NemotronForCausalLM"]}


def weight_rules(m: ModelConfig):
    return [*embedding_rules(m), *layer_norm_rules(m), *attention_rules(m),
            *mlp_rules("decoder.layers.{L}.mlp", "model.layers.{L}.mlp", gated=False)]
