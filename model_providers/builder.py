"""ModelConfig -> megatron-core parts: a TransformerConfig, the layer specs and a GPTModel per stage.

One builder serves every family: what differs between families (HF config keys, weight names)
lives in their modules; the architecture itself is described by ModelConfig's fields.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rl import platform
from megatron_rl.config import ModelConfig, ParallelConfig

VOCAB_MULTIPLE = 128
"""Vocabularies are padded to a multiple of this, the same at every TP size, so that checkpoints
reshard between layouts (TP must divide it)."""


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


ADAPTERS = "_lora"
"""megatron_rl/training/lora.py adds a layer's LoRA adapters as its sibling module `<layer>_lora`."""


def is_adapter(name: str) -> bool:
    """Whether a parameter's (or a module's) name lies inside a layer's LoRA adapters."""
    return f"{ADAPTERS}." in name


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


def _fp8_kwargs(f) -> dict:
    """megatron-core's fp8_* settings of an FP8Config."""
    return dict(fp8=f.format, fp8_recipe=f.recipe, fp8_param=f.param,
                first_last_layers_bf16=bool(f.bf16_first_layers or f.bf16_last_layers),
                num_layers_at_start_in_bf16=f.bf16_first_layers, num_layers_at_end_in_bf16=f.bf16_last_layers)


def te_available() -> bool:
    if not platform.has_cuda():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _activation(name: str):
    from megatron.core.activations import squared_relu

    return {"swiglu": F.silu, "silu": F.silu, "gelu": F.gelu, "squared_relu": squared_relu}[name]


def _moe_kwargs(m: ModelConfig, p: ParallelConfig) -> dict:
    if not m.num_experts:
        return {}
    return dict(
        num_moe_experts=m.num_experts,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_ffn_hidden_size or None,
        moe_layer_freq=[int(m.is_moe_layer(i)) for i in range(m.num_layers)],
        moe_router_topk=m.moe_topk,
        moe_router_score_function=m.moe_score_function,
        moe_router_pre_softmax=m.moe_pre_softmax,
        moe_router_enable_expert_bias=m.moe_expert_bias,
        moe_router_bias_update_rate=m.moe_expert_bias_update_rate,
        moe_router_num_groups=m.moe_num_groups or None,
        moe_router_group_topk=m.moe_group_topk or None,
        moe_router_topk_scaling_factor=m.moe_topk_scaling_factor if m.moe_topk_scaling_factor != 1.0 else None,
        moe_router_load_balancing_type=m.moe_aux_loss_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_dtype=None if m.moe_router_dtype == "model" else m.moe_router_dtype,
        moe_expert_capacity_factor=m.moe_capacity_factor or None,
        moe_token_dispatcher_type=m.moe_dispatcher,
        moe_grouped_gemm=te_available(),  # TEGroupedMLP with TE; SequentialMLP otherwise
        expert_tensor_parallel_size=p.etp or p.tp,
    )


def _recompute_kwargs(recompute: str) -> dict:
    if recompute == "selective":
        return dict(recompute_granularity="selective")
    if recompute == "full":  # every layer's activations are recomputed in the backward
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


def _mla_kwargs(m: ModelConfig) -> dict:
    return dict(
        q_lora_rank=m.q_lora_rank or None,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="yarn" if m.rope_scaling == "yarn" else "rope",
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        rotary_scaling_factor=m.rope_scaling_factor,
        original_max_position_embeddings=m.rope_original_max_position,
        beta_fast=m.yarn_beta_fast,
        beta_slow=m.yarn_beta_slow,
        mscale=m.yarn_mscale,
        mscale_all_dim=m.yarn_mscale_all_dim,
    )


@dataclass
class Provider:
    model: ModelConfig
    parallel: ParallelConfig
    dtype: torch.dtype = torch.float32
    """Parameter dtype: bf16 on GPU, fp32 on CPU."""
    fp8: object = None
    """The FP8Config (format 'off' or None: bf16); ignored without Transformer Engine (the planner)."""
    recompute: str = "none"
    cuda_graphs: bool = False
    """megatron's local CUDA graphs for the rollout's decode steps (rollout.cuda_graphs on CUDA; training
    stays eager: platform/fixes.py)."""

    def transformer_config(self):
        from megatron.core.transformer import MLATransformerConfig, TransformerConfig

        m, p = self.model, self.parallel
        kwargs = dict(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups or m.num_attention_heads,
            kv_channels=m.head_dim or m.hidden_size // m.num_attention_heads,
            normalization=m.normalization,
            layernorm_zero_centered_gamma=m.zero_centered_gamma,
            layernorm_epsilon=m.norm_epsilon,
            gated_linear_unit=m.activation == "swiglu",
            activation_func=_activation(m.activation),
            add_bias_linear=False,
            add_qkv_bias=m.qkv_bias,
            qk_layernorm=m.qk_layernorm,
            window_size=(m.sliding_window - 1, 0) if m.sliding_window else None,
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
            # gloo pairs a sender's messages with a receiver's posted receives in order. Batched p2p
            # posts sends and receives to a peer in an order that differs between the two sides, so
            # at PP=2 with a virtual pipeline (prev == next rank) an activation lands in a gradient's
            # buffer and vice versa. megatron's unbatched path orders them by even/odd rank.
            batch_p2p_comm=platform.has_cuda(),
            bf16=self.dtype == torch.bfloat16,
            use_cpu_initialization=not platform.has_cuda(),
            # Fusions below need apex/TE kernels; the unfused torch paths are exact.
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            calculate_per_token_loss=True,  # losses are normalized by global token counts
            cuda_graph_impl="local" if self.cuda_graphs else "none",
            cuda_graph_scope=[],  # the whole layer; megatron's default "full" means the same and warns it is deprecated
            num_layers_in_first_pipeline_stage=p.first_stage_layers or None,
            num_layers_in_last_pipeline_stage=p.last_stage_layers or None,
            **_recompute_kwargs(self.recompute),
            **(_fp8_kwargs(self.fp8) if self.fp8 is not None and self.fp8.format != "off" and te_available() else {}),
            **_moe_kwargs(m, p),
        )
        if m.multi_latent_attention:
            return MLATransformerConfig(**kwargs, **_mla_kwargs(m))
        if m.hybrid_pattern:
            kwargs.update(is_hybrid_model=True, mamba_state_dim=m.mamba_state_dim, mamba_head_dim=m.mamba_head_dim,
                          mamba_num_groups=m.mamba_num_groups, mamba_num_heads=m.mamba_num_heads or None)
        return TransformerConfig(**kwargs)

    def layer_spec(self, config, vp_stage=None):
        """Specs of this stage's layers: Transformer Engine's modules where TE runs, else
        megatron-core's local modules with our Norm."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        use_te = te_available()
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                          normalization=self.model.normalization, vp_stage=vp_stage)
        return _swap_modules(spec, local=not use_te)

    def hybrid_spec(self):
        """The MambaStack spec of a hybrid model, from megatron-core's local modules and ours (its
        own spec is Transformer Engine's only): Mamba-2 layers (norm, then the mixer), attention
        layers, MLP layers and MoE layers."""
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
        from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
        from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
        from megatron.core.ssm.mlp_layer import MLPLayer
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.mlp import MLP, MLPSubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                                 TransformerLayerSubmodules)

        from megatron_rl.platform.attention import CoreAttention
        from megatron_rl.platform.norm import Norm

        m = self.model
        spec = ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
            mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
                norm=Norm,
                mixer=ModuleSpec(module=MambaMixer,
                                 params={"d_conv": m.mamba_conv_kernel, "chunk_size": m.mamba_chunk_size},
                                 submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                                 out_proj=RowParallelLinear)),
                mamba_bda=get_bias_dropout_add)),
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
                input_layernorm=Norm,
                self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                          submodules=SelfAttentionSubmodules(
                                              linear_qkv=ColumnParallelLinear, core_attention=CoreAttention,
                                              linear_proj=RowParallelLinear)),
                self_attn_bda=get_bias_dropout_add)),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=Norm,
                mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                    linear_fc2=RowParallelLinear)),
                mlp_bda=get_bias_dropout_add)),
        ))
        if m.num_experts:
            spec.submodules.moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=Norm, mlp=get_moe_module_spec(use_te=False, num_experts=m.num_experts,
                                                                moe_grouped_gemm=False),
                mlp_bda=get_bias_dropout_add))
        return _swap_modules(spec, local=True)

    def build_stage(self, config, pre_process: bool, post_process: bool, vp_stage=None):
        """The GPTModel (MambaModel for a hybrid) holding this rank's layers of one (virtual)
        pipeline stage."""
        from megatron.core.models.gpt import GPTModel

        from .heads import score_model_class

        m = self.model
        if m.hybrid_pattern:
            from megatron.core.models.mamba import MambaModel

            return MambaModel(config=config, mamba_stack_spec=self.hybrid_spec(),
                              vocab_size=padded_vocab_size(m.vocab_size), max_sequence_length=m.max_position_embeddings,
                              pre_process=pre_process, post_process=post_process,
                              hybrid_override_pattern=m.hybrid_pattern,
                              share_embeddings_and_output_weights=m.tie_embeddings, position_embedding_type="none")
        # A reward model's last stage ends in a scalar head (embeddings untied) instead of the vocabulary.
        model_class, tied = (score_model_class(), {}) if m.head == "score" else (
            GPTModel, {"share_embeddings_and_output_weights": m.tie_embeddings})
        model = model_class(
            config=config,
            transformer_layer_spec=self.layer_spec(config, vp_stage),
            vocab_size=padded_vocab_size(m.vocab_size),
            max_sequence_length=m.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            **tied,
            position_embedding_type="rope",
            rotary_percent=m.rotary_percent,
            rotary_base=int(m.rotary_base),
            vp_stage=vp_stage,
        )
        if m.rope_scaling == "llama3" and not m.multi_latent_attention:
            # megatron's llama3 scaling takes only the factor from GPTModel; apply it with all of
            # the checkpoint's parameters instead.
            rope = model.rotary_pos_emb
            rope.inv_freq = rope._apply_scaling(
                rope.inv_freq, factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                high_freq_factor=m.rope_high_freq_factor,
                original_max_position_embeddings=m.rope_original_max_position)
        return model


def _swap_modules(spec, local: bool):
    """Replace modules throughout a spec tree by ours: multi-latent attention by the one that rolls
    out from a latent cache; with megatron's local fallbacks (local=True) also the norm (zero-centered
    gamma, sequence parallel) and the core attention (MLA's unequal head sizes)."""
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_rl.platform.attention import CoreAttention
    from .latent_attention import LatentCacheMLASelfAttention
    from megatron_rl.platform.norm import Norm

    swaps = {MLASelfAttention: LatentCacheMLASelfAttention}
    if local:
        swaps.update({WrappedTorchNorm: Norm, DotProductAttention: CoreAttention})
        try:
            from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

            swaps[FusedLayerNorm] = Norm
        except ImportError:
            pass

    def visit(node):
        if isinstance(node, ModuleSpec):
            node.module = visit(node.module)
            node.submodules = visit(node.submodules)
            return node
        if isinstance(node, list):
            return [visit(x) for x in node]
        if isinstance(node, type):
            return swaps.get(node, node)
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                setattr(node, f.name, visit(getattr(node, f.name)))
        return node

    return visit(spec)
