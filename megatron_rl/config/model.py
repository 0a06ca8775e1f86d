"""The model section: the architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import ConfigError, positive


@dataclass(kw_only=True)
class ModelConfig:
    """The architecture. A Hugging Face checkpoint fills it through its family's provider
    (model.hf_path); recipes that train from scratch set it directly."""

    family: str = "llama"
    """Model family in model_providers/: llama, qwen, mixtral, deepseek, nemotron."""
    num_layers: int = 2
    """Transformer layers (with hybrid_pattern: its length)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    ffn_hidden_size: int = 256
    """Hidden size of dense MLPs."""
    num_attention_heads: int = 4
    """Query heads per attention layer."""
    num_query_groups: int = 0
    """Key/value heads for GQA; 0 means as many as attention heads (plain multi-head attention)."""
    head_dim: int = 0
    """Channels per head; 0 means hidden_size // num_attention_heads."""
    vocab_size: int = 0
    """0 means take it from the tokenizer. Padded internally to a multiple of 128."""
    max_position_embeddings: int = 4096
    """The longest sequence the model is made for; data.seq_length is fit to it."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """The norm of every layer and the final one."""
    zero_centered_gamma: bool = False
    """Norm weights stored as gamma - 1 (Nemotron's LayerNorm1P)."""
    norm_epsilon: float = 1e-6
    """Epsilon of the norms."""
    activation: Literal["swiglu", "squared_relu", "gelu", "silu"] = "swiglu"
    """MLP activation; swiglu is the gated SiLU (gate and up projections)."""
    tie_embeddings: bool = False
    """The output layer shares the input embedding's weights."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys per head (Qwen3); with MLA, the norms of the compressed q and kv."""
    qkv_bias: bool = False
    """Bias on the query/key/value projection (Qwen2)."""
    sliding_window: int = 0
    """Attend to at most this many most recent tokens (Mistral); 0 means full causal attention."""
    rotary_base: float = 10000.0
    """Rotary embeddings' base (theta)."""
    rotary_percent: float = 1.0
    """Share of each head's channels that get rotary embeddings (Nemotron: 0.5)."""
    rope_scaling: Literal["none", "llama3", "yarn"] = "none"
    """Rotary scaling for long contexts: llama3's or YaRN's; none keeps the base frequencies."""
    rope_scaling_factor: float = 1.0
    """How many times the pretrained context the scaling stretches to."""
    rope_low_freq_factor: float = 1.0
    """llama3 rope scaling."""
    rope_high_freq_factor: float = 4.0
    """llama3 rope scaling."""
    rope_original_max_position: int = 8192
    """llama3 and yarn rope scaling: the context length the model was pretrained at."""
    yarn_beta_fast: float = 32.0
    """YaRN rope scaling: the fast boundary of the interpolation ramp."""
    yarn_beta_slow: float = 1.0
    """YaRN rope scaling: the slow boundary of the interpolation ramp."""
    yarn_mscale: float = 1.0
    """YaRN rope scaling: the attention scale's coefficient."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN rope scaling: the attention scale's coefficient over all dimensions (DeepSeek-V3)."""
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (MLA); the q/kv sizes below apply."""
    q_lora_rank: int = 0
    """MLA: rank of the compressed query; 0 means queries are not compressed."""
    kv_lora_rank: int = 0
    """Multi-latent attention: the rank of the compressed key/value latent (the cache holds it)."""
    qk_head_dim: int = 0
    """MLA: query/key channels per head without rotary embedding."""
    qk_pos_head_dim: int = 0
    """MLA: query/key channels per head with rotary embedding."""
    v_head_dim: int = 0
    """Multi-latent attention: channels per value head."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 means a dense model."""
    moe_ffn_hidden_size: int = 0
    """Hidden size of each expert's MLP."""
    moe_shared_ffn_hidden_size: int = 0
    """Hidden size of the shared experts (all of them together); 0 means none."""
    moe_first_dense_layers: int = 0
    """The first N layers are dense (DeepSeek's first_k_dense_replace)."""
    moe_topk: int = 2
    """Experts each token is routed to."""
    moe_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """The router's scores: softmax over the experts, or sigmoid (DeepSeek-V3, Nemotron-H)."""
    moe_pre_softmax: bool = False
    """Softmax over all experts, then top-k, without renormalizing; false: softmax over the top-k."""
    moe_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only (DeepSeek-V3)."""
    moe_expert_bias_update_rate: float = 0.0
    """How fast training moves that bias toward balanced load; 0 keeps it fixed (the RL default)."""
    moe_num_groups: int = 0
    """Group-limited routing: experts in this many groups, tokens routed within moe_group_topk of them."""
    moe_group_topk: int = 0
    """Group-limited routing (DeepSeek-V3): tokens choose experts within this many of the groups; 0: off."""
    moe_topk_scaling_factor: float = 1.0
    """Routing weights are multiplied by this (DeepSeek-V3: 2.5)."""
    moe_aux_loss_type: Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"] = "none"
    """The load-balancing loss: none, aux_loss (per microbatch), seq_aux_loss (per sequence) or global_aux_loss."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss."""
    moe_router_dtype: Literal["fp32", "fp64", "model"] = "fp32"
    """Precision of the router's logits and probabilities; 'model' uses the model's dtype."""
    moe_router_frozen: bool = False
    """Keep the router's weights as loaded (NeMo RL's freeze_moe_router): RL then moves the experts,
    not which experts a token goes to."""
    moe_capacity_factor: float = 0.0
    """Tokens per expert are capped at this factor times the even share; 0 means no dropping."""
    moe_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    """megatron's token dispatcher: allgather, or alltoall (expert parallelism across ranks)."""
    hybrid_pattern: str = ""
    """A hybrid model (Nemotron-H): one symbol per layer, 'M' Mamba-2, '*' attention (without
    rotary embeddings), '-' MLP, 'E' MoE (megatron's hybrid_override_pattern); empty: every layer is
    attention followed by an MLP."""
    mamba_num_heads: int = 0
    """Mamba-2 heads of a hybrid's Mamba layers (their inner width is heads x mamba_head_dim)."""
    mamba_head_dim: int = 64
    """Mamba-2 layers: channels per head."""
    mamba_num_groups: int = 8
    """Groups sharing B and C (the key/value groups of Mamba-2)."""
    mamba_state_dim: int = 128
    """Mamba-2 layers: the SSM state size per group."""
    mamba_conv_kernel: int = 4
    """Mamba-2 layers: the causal convolution's width."""
    mamba_chunk_size: int = 128
    """Tokens per chunk of the chunked scan (an implementation choice; the result does not depend on it)."""
    init_method_std: float = 0.02
    """Standard deviation of the random initialization (a model trained from scratch)."""
    hf_path: str = ""
    """A Hugging Face checkpoint directory: its config.json sets this section and its weights
    are loaded at the start (see tools/convert_checkpoint.py)."""
    head: Literal["lm", "score"] = "lm"
    """What sits on the last layer: the vocabulary output layer ('lm'), or one scalar per token
    ('score': a reward model, algorithm.name=rm; embeddings are then untied). A score model
    started from a language model drops its output layer and gets a fresh head."""

    def validate(self):
        positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={groups}; pick a number of key/value heads that divides it.")
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                f"{self.num_attention_heads}; set model.head_dim explicitly or change the sizes.")
        if self.num_experts:
            positive(self, "moe_ffn_hidden_size", "moe_topk")
            if self.moe_topk > self.num_experts:
                raise ConfigError(f"model.moe_topk={self.moe_topk} exceeds model.num_experts={self.num_experts}.")
            if self.moe_num_groups and self.num_experts % self.moe_num_groups:
                raise ConfigError(f"model.num_experts={self.num_experts} is not divisible by "
                                  f"model.moe_num_groups={self.moe_num_groups}.")
        if self.multi_latent_attention:
            positive(self, "kv_lora_rank", "qk_head_dim", "qk_pos_head_dim", "v_head_dim")
        if self.hybrid_pattern:
            self._validate_hybrid()

    HYBRID_SYMBOLS: ClassVar[dict[str, str]] = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}

    def _validate_hybrid(self):
        pattern = self.hybrid_pattern
        unknown = sorted(set(pattern) - set(self.HYBRID_SYMBOLS))
        if unknown:
            raise ConfigError(f"model.hybrid_pattern has {', '.join(map(repr, unknown))}, not a layer symbol; use "
                              + ", ".join(f"{s!r} ({kind})" for s, kind in self.HYBRID_SYMBOLS.items()) + ".")
        if len(pattern) != self.num_layers:
            raise ConfigError(f"model.hybrid_pattern has {len(pattern)} layers but model.num_layers={self.num_layers}; "
                              "give one symbol per layer.")
        if "E" in pattern and not self.num_experts:
            raise ConfigError("model.hybrid_pattern has MoE layers ('E'): set model.num_experts and "
                              "model.moe_ffn_hidden_size.")
        if "M" in pattern:
            positive(self, "mamba_num_heads", "mamba_head_dim", "mamba_num_groups", "mamba_state_dim",
                     "mamba_conv_kernel", "mamba_chunk_size")
            if self.mamba_num_heads % self.mamba_num_groups:
                raise ConfigError(f"model.mamba_num_heads={self.mamba_num_heads} is not divisible by "
                                  f"model.mamba_num_groups={self.mamba_num_groups}.")
        if self.multi_latent_attention or self.head != "lm":
            raise ConfigError("a hybrid model (model.hybrid_pattern) has plain attention and a language-model head; "
                              "unset model.multi_latent_attention and keep model.head=lm.")

    TRAINING_CHOICES: ClassVar[tuple[str, ...]] = (
        "hf_path", "head", "init_method_std", "moe_aux_loss_type", "moe_aux_loss_coeff", "moe_expert_bias_update_rate",
        "moe_router_dtype", "moe_router_frozen", "moe_capacity_factor", "moe_dispatcher")
    """Fields that are choices of a training run rather than of the architecture: a checkpoint or HF
    model does not fix them."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether (0-based) layer `layer` has routed experts."""
        if self.hybrid_pattern:
            return self.hybrid_pattern[layer] == "E"
        return bool(self.num_experts) and layer >= self.moe_first_dense_layers
