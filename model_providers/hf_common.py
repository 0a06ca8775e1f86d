"""Pieces of HF config translation and weight rules that several families share."""

from megatron_rl.config import ConfigError, ModelConfig

from .mapping import Rule

LAYER = "decoder.layers.{L}"


def rope_from_hf(hf: dict) -> dict:
    """ModelConfig fields from HF rope settings (transformers 5 `rope_parameters`, or the older
    `rope_theta` + `rope_scaling`)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    out = dict(rotary_base=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
               rotary_percent=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))))
    if kind == "default":
        return out
    if kind == "llama3":
        return {**out, "rope_scaling": "llama3", "rope_scaling_factor": float(params["factor"]),
                "rope_low_freq_factor": float(params["low_freq_factor"]),
                "rope_high_freq_factor": float(params["high_freq_factor"]),
                "rope_original_max_position": int(params["original_max_position_embeddings"])}
    if kind == "yarn":
        return {**out, "rope_scaling": "yarn", "rope_scaling_factor": float(params["factor"]),
                "rope_original_max_position": int(params["original_max_position_embeddings"]),
                "yarn_beta_fast": float(params.get("beta_fast", 32.0)),
                "yarn_beta_slow": float(params.get("beta_slow", 1.0)),
                "yarn_mscale": float(params.get("mscale", 1.0)),
                "yarn_mscale_all_dim": float(params.get("mscale_all_dim", 0.0))}
    raise ConfigError(f"rope type {kind!r} in config.json is not supported; supported: default, llama3, yarn.")


def rope_to_hf(m: ModelConfig) -> dict:
    """transformers 5 `rope_parameters` for a ModelConfig."""
    params = {"rope_theta": m.rotary_base, "rope_type": "default" if m.rope_scaling == "none" else m.rope_scaling}
    if m.rotary_percent != 1.0:
        params["partial_rotary_factor"] = m.rotary_percent
    if m.rope_scaling == "llama3":
        params.update(factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                      high_freq_factor=m.rope_high_freq_factor,
                      original_max_position_embeddings=m.rope_original_max_position)
    elif m.rope_scaling == "yarn":
        params.update(factor=m.rope_scaling_factor, original_max_position_embeddings=m.rope_original_max_position,
                      beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow, mscale=m.yarn_mscale,
                      mscale_all_dim=m.yarn_mscale_all_dim)
    return params


def base_from_hf(hf: dict, **extra) -> dict:
    """The fields every decoder family shares, read from config.json."""
    heads = hf["num_attention_heads"]
    fields = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"], max_position_embeddings=hf.get("max_position_embeddings", 4096),
        norm_epsilon=hf.get("rms_norm_eps", hf.get("norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=hf.get("initializer_range", 0.02), **rope_from_hf(hf))
    return {**fields, **extra}


def base_to_hf(m: ModelConfig) -> dict:
    """config.json keys every decoder family shares."""
    return dict(
        num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=m.head_dim or m.hidden_size // m.num_attention_heads, vocab_size=m.vocab_size,
        max_position_embeddings=m.max_position_embeddings, tie_word_embeddings=m.tie_embeddings,
        initializer_range=m.init_method_std, rope_parameters=rope_to_hf(m))


def require(hf: dict, key: str, allowed, family: str):
    """Refuse an HF setting the family's translation does not cover, naming it."""
    value = hf.get(key)
    if value not in allowed:
        raise ConfigError(f"config.json has {key}={value!r}, which the {family} converter does not support "
                          f"(supported: {', '.join(map(repr, allowed))}).")


# --- weight rules -------------------------------------------------------------------------------


def norm_rules(megatron: str, hf: str, m: ModelConfig) -> list[Rule]:
    """A norm's weight (and bias for LayerNorm)."""
    rules = [Rule(f"{megatron}.weight", (f"{hf}.weight",))]
    if m.normalization == "LayerNorm":
        rules.append(Rule(f"{megatron}.bias", (f"{hf}.bias",)))
    return rules


def embedding_rules(m: ModelConfig) -> list[Rule]:
    """Embedding, final norm and the head: the vocabulary's (lm_head, unless tied) or a reward
    model's scalar one (transformers' *ForSequenceClassification `score`)."""
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
             *norm_rules("decoder.final_layernorm", "model.norm", m)]
    if m.head == "score":
        rules.append(Rule("score_head.weight", ("score.weight",)))
    elif not m.tie_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


def attention_rules(m: ModelConfig, hf: str = "model.layers.{L}.self_attn") -> list[Rule]:
    """Grouped-query attention with HF's separate q/k/v projections."""
    att = f"{LAYER}.self_attention"
    rules = [Rule(f"{att}.linear_qkv.weight", (f"{hf}.q_proj.weight", f"{hf}.k_proj.weight", f"{hf}.v_proj.weight"), "qkv"),
             Rule(f"{att}.linear_proj.weight", (f"{hf}.o_proj.weight",))]
    if m.qkv_bias:
        rules.append(Rule(f"{att}.linear_qkv.bias", (f"{hf}.q_proj.bias", f"{hf}.k_proj.bias", f"{hf}.v_proj.bias"), "qkv"))
    if m.qk_layernorm:
        rules += [Rule(f"{att}.q_layernorm.weight", (f"{hf}.q_norm.weight",)),
                  Rule(f"{att}.k_layernorm.weight", (f"{hf}.k_norm.weight",))]
    return rules


def layer_norm_rules(m: ModelConfig) -> list[Rule]:
    return [*norm_rules(f"{LAYER}.input_layernorm", "model.layers.{L}.input_layernorm", m),
            *norm_rules(f"{LAYER}.pre_mlp_layernorm", "model.layers.{L}.post_attention_layernorm", m)]


def mlp_rules(megatron: str, hf: str, gated: bool = True, names=("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """A dense MLP (or one expert): gated -> linear_fc1 = [gate; up]."""
    gate, up, down = names
    fc1 = (Rule(f"{megatron}.linear_fc1.weight", (f"{hf}.{gate}.weight", f"{hf}.{up}.weight"), "glu") if gated
           else Rule(f"{megatron}.linear_fc1.weight", (f"{hf}.{up}.weight",)))
    return [fc1, Rule(f"{megatron}.linear_fc2.weight", (f"{hf}.{down}.weight",))]


def fused_expert_rules(hf: str) -> list[Rule]:
    """Experts as transformers 5 keeps them in memory (and writes with save_original_format=False):
    one gate_up_proj (E, 2I, H) and one down_proj (E, H, I) per layer. Import only."""
    return [Rule(f"{LAYER}.mlp.experts.{{E}}.linear_fc1.weight", (f"{hf}.gate_up_proj",), "expert"),
            Rule(f"{LAYER}.mlp.experts.{{E}}.linear_fc2.weight", (f"{hf}.down_proj",), "expert")]
