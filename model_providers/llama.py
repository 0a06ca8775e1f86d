"""Llama and Mistral: RMSNorm, rotary embeddings (llama3 scaling), SwiGLU MLP, GQA, sliding window."""

from megatron_rl.config import ConfigError, ModelConfig

from .hf_common import attention_rules, base_from_hf, base_to_hf, embedding_rules, layer_norm_rules, mlp_rules, require

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def from_hf(hf: dict) -> ModelConfig:
    require(hf, "hidden_act", ("silu",), "llama")
    for key in ("attention_bias", "mlp_bias"):
        require(hf, key, (False, None), "llama")
    return ModelConfig(family="llama", **base_from_hf(hf, sliding_window=hf.get("sliding_window") or 0))


def to_hf(m: ModelConfig) -> dict:
    from transformers import LlamaConfig, MistralConfig

    if m.qk_layernorm or m.qkv_bias or m.num_experts or m.activation != "swiglu" or m.normalization != "RMSNorm":
        raise ConfigError("this model has features Llama lacks (q/k norm, qkv bias, experts or another "
                          "activation/norm); set model.family to qwen, mixtral or nemotron to export it.")
    common = dict(**base_to_hf(m), rms_norm_eps=m.norm_epsilon, hidden_act="silu")
    if m.sliding_window:
        return {**MistralConfig(**common, sliding_window=m.sliding_window).to_dict(),
                "architectures": ["MistralForCausalLM"]}
    return {**LlamaConfig(**common).to_dict(), "architectures": ["LlamaForCausalLM"]}


def weight_rules(m: ModelConfig):
    return [*embedding_rules(m), *layer_norm_rules(m), *attention_rules(m),
            *mlp_rules("decoder.layers.{L}.mlp", "model.layers.{L}.mlp")]
