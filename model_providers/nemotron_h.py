"""Nemotron-H hybrids (transformers' NemotronHForCausalLM: Nemotron-H, Nemotron Nano 2, Nemotron 3
Nano): one mixer per layer, Mamba-2 ('M'), attention without rotary embeddings ('*'), a squared-ReLU
MLP ('-') or a sigmoid-routed MoE with a shared expert ('E'); RMSNorm before each mixer.

Weights keep their on-disk names (`backbone.layers.N.mixer.*`, one tensor per expert). The Mamba
input projection is [z | x | B | C | dt] and the convolution [x | B | C]: megatron shards each part
over tensor parallelism (hf/weights.py places them part by part).
"""

from megatron_rl.config import ConfigError, ModelConfig

from .mapping import Rule

ARCHITECTURES = ("NemotronHForCausalLM",)

# transformers 5 writes the layer kinds as a list; older configs as megatron's pattern string
BLOCK_TYPES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
MAMBA_FIELDS = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")


def _pattern(hf: dict) -> str:
    if hf.get("hybrid_override_pattern"):
        return hf["hybrid_override_pattern"]
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if not kinds:
        raise ConfigError("config.json of a NemotronH model gives no layer pattern (hybrid_override_pattern or "
                          "layers_block_type).")
    unknown = sorted(set(kinds) - set(BLOCK_TYPES))
    if unknown:
        raise ConfigError(f"config.json has layer types {', '.join(map(repr, unknown))}; the nemotron_h converter "
                          f"knows {', '.join(sorted(BLOCK_TYPES))}.")
    return "".join(BLOCK_TYPES[k] for k in kinds)


def _require(hf: dict, key: str, allowed, default=None):
    value = hf.get(key, default)
    if value not in allowed:
        raise ConfigError(f"config.json has {key}={value!r}, which the nemotron_h converter does not support "
                          f"(supported: {', '.join(map(repr, allowed))}).")


def from_hf(hf: dict) -> ModelConfig:
    pattern = _pattern(hf)
    if "M" in pattern:
        missing = [k for k in MAMBA_FIELDS if k not in hf and not (k == "n_groups" and "mamba_n_groups" in hf)]
        if missing:
            raise ConfigError(f"config.json has Mamba layers but lacks {', '.join(missing)}; it is not a complete "
                              "NemotronH config.")
    _require(hf, "mlp_hidden_act", ("relu2",), "relu2")
    _require(hf, "mamba_hidden_act", ("silu",), "silu")
    for key in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
        _require(hf, key, (False, None))
    _require(hf, "use_conv_bias", (True, None))
    _require(hf, "moe_latent_size", (None, 0))
    # megatron-core's Mamba layer applies no time-step limit and normalizes its gate with eps 1e-5
    limit = [float(x["__float__"]) if isinstance(x, dict) else float(x)  # transformers writes inf as {"__float__": ...}
             for x in hf.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        raise ConfigError(f"config.json has time_step_limit={limit!r}; megatron-core's Mamba layer applies none, so "
                          "the nemotron_h converter supports only (0.0, inf).")
    _require(hf, "layer_norm_epsilon", (1e-5,), 1e-5)
    heads = hf["num_attention_heads"]
    fields = dict(
        num_layers=len(pattern), hidden_size=hf["hidden_size"], ffn_hidden_size=hf.get("intermediate_size", 0),
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf.get("attention_head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"], max_position_embeddings=hf.get("max_position_embeddings", 4096),
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=hf.get("initializer_range", 0.02), activation="squared_relu", hybrid_pattern=pattern,
        mamba_num_heads=hf.get("mamba_num_heads", 0), mamba_head_dim=hf.get("mamba_head_dim", 64),
        mamba_num_groups=hf.get("n_groups", hf.get("mamba_n_groups", 8)), mamba_state_dim=hf.get("ssm_state_size", 128),
        mamba_conv_kernel=hf.get("conv_kernel", 4), mamba_chunk_size=hf.get("chunk_size", 128))
    if "E" in pattern:
        _require(hf, "norm_topk_prob", (True,))  # megatron's sigmoid router renormalizes the top k
        fields.update(
            num_experts=hf["n_routed_experts"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_shared_ffn_hidden_size=(hf.get("moe_shared_expert_intermediate_size", 0)
                                        * (hf.get("n_shared_experts") or 1)),
            moe_topk=hf["num_experts_per_tok"], moe_score_function="sigmoid", moe_expert_bias=True,
            moe_num_groups=hf.get("n_group") if (hf.get("n_group") or 1) > 1 else 0,
            moe_group_topk=hf.get("topk_group") if (hf.get("n_group") or 1) > 1 else 0,
            moe_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
    return ModelConfig(family="nemotron_h", **fields)


def to_hf(m: ModelConfig) -> dict:
    from transformers import NemotronHConfig

    if not m.hybrid_pattern or m.activation != "squared_relu" or m.normalization != "RMSNorm" or m.qk_layernorm \
            or m.qkv_bias or (m.num_experts and m.moe_score_function != "sigmoid"):
        raise ConfigError("this model does not fit a NemotronH config (a hybrid pattern, squared-ReLU MLPs, RMSNorm, "
                          "sigmoid-routed experts, no q/k norm or qkv bias).")
    kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    moe = dict(n_routed_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_hidden_size,
               moe_shared_expert_intermediate_size=m.moe_shared_ffn_hidden_size, n_shared_experts=1,
               num_experts_per_tok=m.moe_topk, n_group=m.moe_num_groups or 1, topk_group=m.moe_group_topk or 1,
               routed_scaling_factor=m.moe_topk_scaling_factor, norm_topk_prob=True) if m.num_experts else {}
    config = NemotronHConfig(
        hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=m.head_dim or m.hidden_size // m.num_attention_heads, vocab_size=m.vocab_size,
        max_position_embeddings=m.max_position_embeddings, layer_norm_epsilon=m.norm_epsilon,
        tie_word_embeddings=m.tie_embeddings, initializer_range=m.init_method_std,
        layers_block_type=[kinds[s] for s in m.hybrid_pattern], mamba_num_heads=m.mamba_num_heads,
        mamba_head_dim=m.mamba_head_dim, n_groups=m.mamba_num_groups, ssm_state_size=m.mamba_state_dim,
        conv_kernel=m.mamba_conv_kernel, chunk_size=m.mamba_chunk_size, mlp_hidden_act="relu2", **moe)
    return {**config.to_dict(), "architectures": ["NemotronHForCausalLM"]}


def skipped(name: str, m: ModelConfig) -> str | None:
    """Why an HF tensor is left out on import, or None: multi-token prediction layers."""
    if name.startswith("mtp."):
        return "multi-token prediction (MTP) layers are not converted"
    return None


def weight_rules(m: ModelConfig) -> list[Rule]:
    """Rules per layer, by the layer's kind in the pattern (the same HF norm name maps to the norm
    of whatever mixer the layer has)."""
    rules = [Rule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",), "vocab"),
             Rule("decoder.final_norm.weight", ("backbone.norm_f.weight",))]
    if not m.tie_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    for i, kind in enumerate(m.hybrid_pattern):
        ours, hf = f"decoder.layers.{i}", f"backbone.layers.{i}"
        if kind == "M":
            rules.append(Rule(f"{ours}.norm.weight", (f"{hf}.norm.weight",)))
            rules += [Rule(f"{ours}.mixer.{name}", (f"{hf}.mixer.{name}",)) for name in (
                "in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                "out_proj.weight")]
        elif kind == "*":
            rules += [Rule(f"{ours}.input_layernorm.weight", (f"{hf}.norm.weight",)),
                      Rule(f"{ours}.self_attention.linear_qkv.weight",
                           tuple(f"{hf}.mixer.{p}_proj.weight" for p in "qkv"), "qkv"),
                      Rule(f"{ours}.self_attention.linear_proj.weight", (f"{hf}.mixer.o_proj.weight",))]
        else:
            rules.append(Rule(f"{ours}.pre_mlp_layernorm.weight", (f"{hf}.norm.weight",)))
            mlps = [("mlp", "mixer")] if kind == "-" else [
                ("mlp.shared_experts", "mixer.shared_experts"), ("mlp.experts.{E}", "mixer.experts.{E}")]
            for mine, theirs in mlps:
                rules += [Rule(f"{ours}.{mine}.linear_fc1.weight", (f"{hf}.{theirs}.up_proj.weight",)),
                          Rule(f"{ours}.{mine}.linear_fc2.weight", (f"{hf}.{theirs}.down_proj.weight",))]
            if kind == "E":
                rules += [Rule(f"{ours}.mlp.router.weight", (f"{hf}.mixer.gate.weight",)),
                          Rule(f"{ours}.mlp.router.expert_bias", (f"{hf}.mixer.gate.e_score_correction_bias",))]
    return rules
