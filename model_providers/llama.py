"""Llama-style dense decoders: RMSNorm, rotary embeddings, SwiGLU MLP, GQA.

Covers Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm) shapes through ModelConfig flags.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rl.config import ModelConfig, ParallelConfig

VOCAB_MULTIPLE = 128
"""Vocabularies are padded to a multiple of this, the same at every TP size, so that checkpoints
reshard between layouts (TP must divide it)."""


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Provider:
    model: ModelConfig
    parallel: ParallelConfig
    dtype: torch.dtype = torch.float32
    """Parameter dtype: bf16 on GPU, fp32 on CPU."""

    def transformer_config(self):
        from megatron.core.transformer import TransformerConfig

        m, p = self.model, self.parallel
        on_cpu = not torch.cuda.is_available()
        return TransformerConfig(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups or m.num_attention_heads,
            kv_channels=m.head_dim or m.hidden_size // m.num_attention_heads,
            normalization="RMSNorm",
            layernorm_epsilon=m.norm_epsilon,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=m.qkv_bias,
            qk_layernorm=m.qk_layernorm,
            hidden_dropout=0.0,  # RL and exactness tests need a deterministic forward
            attention_dropout=0.0,
            init_method_std=m.init_method_std,
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
            context_parallel_size=p.cp,
            expert_model_parallel_size=p.ep,
            sequence_parallel=p.sp,
            params_dtype=self.dtype,
            pipeline_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            use_cpu_initialization=on_cpu,
            # Fusions below need apex/TE kernels; the unfused torch paths are exact.
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            calculate_per_token_loss=True,  # losses are normalized by global token counts
        )

    def layer_spec(self):
        from megatron.core.models.gpt import gpt_layer_specs

        if te_available():
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                qk_layernorm=self.model.qk_layernorm)
        return gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=self.model.qk_layernorm, normalization="RMSNorm")

    def build_stage(self, config, pre_process: bool, post_process: bool, vp_stage=None):
        """The GPTModel holding this rank's layers of one (virtual) pipeline stage."""
        from megatron.core.models.gpt import GPTModel

        return GPTModel(
            config=config,
            transformer_layer_spec=self.layer_spec(),
            vocab_size=padded_vocab_size(self.model.vocab_size),
            max_sequence_length=self.model.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=self.model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(self.model.rotary_base),
            vp_stage=vp_stage,
        )
