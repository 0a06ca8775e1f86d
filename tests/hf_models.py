"""Tiny random Hugging Face models of every supported family, built locally (no hub).

Weights are redrawn so that activations and logits are O(1): with transformers' default 0.02
init the logits are nearly uniform and a parity test would pass for the wrong reasons.
"""

from pathlib import Path

import torch

VOCAB = 100

# name -> (transformers config class name, kwargs). Shapes vary on purpose: GQA with several kv
# heads, head_dim != hidden/heads, odd layer counts, tied and untied embeddings.
FAMILIES = {
    "llama": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, tie_word_embeddings=False, max_position_embeddings=128,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, sliding_window=5)),
    "qwen2": ("Qwen2Config", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_group=2, topk_group=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0)),
    # no query compression, YaRN rope with mscale: MLA's other paths
    "deepseek_v3_yarn": ("DeepseekV3Config", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=2, num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, n_group=1, topk_group=1, routed_scaling_factor=1.0, num_nextn_predict_layers=0,
        max_position_embeddings=256,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
    "nemotron": ("NemotronConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        partial_rotary_factor=0.5)),
    # a hybrid: Mamba-2 (chunks of 4 tokens, so scans pass state between chunks), attention, MLP, MoE
    "nemotron_h": ("NemotronHConfig", dict(
        hidden_size=64, intermediate_size=96, hybrid_override_pattern="M*M-EM", num_hidden_layers=6,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4,
        layer_norm_epsilon=1e-5, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, num_experts_per_tok=2,
        routed_scaling_factor=2.5, tie_word_embeddings=False)),
}


def randomize_(model, seed: int = 0):
    """Redraw every tensor so the model computes something far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=g)
            if t.dim() == 1:  # norms (around 1, or 0 when zero-centered), biases, router bias
                centered = "norm" in name and type(model).__name__ != "NemotronForCausalLM"  # LayerNorm1P: 0
                t.copy_((1.0 if centered else 0.0) + 0.2 * noise)
            else:
                t.copy_(noise / t.shape[-1] ** 0.5 * (1.0 if "embed" not in name else 3.0))


def make_tokenizer(out_dir: Path):
    from megatron_rl.data.tokenizer import build_char_tokenizer

    return build_char_tokenizer("0123456789+=abcdefghijklmnopqrstuvwxyz ", out_dir)


def save_tiny_model(family: str, out_dir: Path, seed: int = 0, dtype=torch.float32, fused: bool = False,
                    reward_model: bool = False, pad_is_eos: bool = False, **overrides) -> Path:
    """Build, randomize and save_pretrained a tiny model of `family`, with a tokenizer. `fused`:
    write MoE experts in transformers 5's in-memory layout instead of the hub's. `reward_model`: a
    *ForSequenceClassification with one label; `pad_is_eos`: the tokenizer pads with eos."""
    import transformers

    cls_name, kwargs = FAMILIES[family]
    tok = make_tokenizer(out_dir)
    if pad_is_eos:
        tok.pad_token = tok.eos_token
        tok.save_pretrained(str(out_dir))
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, bos_token_id=tok.bos_token_id,
                                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                             **{**kwargs, **overrides}, **({"num_labels": 1} if reward_model else {}))
    auto = transformers.AutoModelForSequenceClassification if reward_model else transformers.AutoModelForCausalLM
    model = auto.from_config(config)
    randomize_(model, seed)
    model.to(dtype).save_pretrained(str(out_dir), save_original_format=not fused)
    return out_dir


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits
