"""Fixes for megatron-core 0.16.1 bugs that do not depend on the device, only on Transformer
Engine (or apex) being absent, or on a virtual pipeline during inference: paths megatron does not
exercise; the gradient of MLA's rotary key at TP > 1 with the local spec; host reads in the packed
rotary embedding; and training kept out of the decode CUDA graphs. Each fix is guarded
by its condition, so nothing changes elsewhere; tests show each is needed (tests/test_platform.py;
for the virtual pipeline, tests/test_sft.py's VPP test, whose GRPO step fails without it; for MLA,
tests/test_latent_attention.py's layout test).
"""

import functools

import torch

from . import hooks


def _needs_torch_adam_fixes(module) -> bool:
    return not module.HAVE_APEX_OR_TE


def _keep_step(set_states):
    """The 'fully_reshardable' loader restores torch Adam's 'step' from the param groups and
    leaves it out of the tensors it hands over, but the setter copies every key of the
    optimizer state (KeyError: 'step'). Let the step keep its restored value."""

    @functools.wraps(set_states)
    def wrapper(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return set_states(self, model_param, tensors)

    return wrapper


def _own_step_per_param(load_state_dict):
    """Loading gives every parameter the same 'step' tensor object, and torch Adam increments
    each parameter's step in place, so after one resumed step the shared count has grown by the
    number of parameters and the bias correction is wrong. Give each parameter its own copy."""

    @functools.wraps(load_state_dict)
    def wrapper(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    return wrapper


def _fix_distrib_optimizer(module):
    if not _needs_torch_adam_fixes(module):
        return
    cls = module.DistributedOptimizer
    cls._set_main_param_and_optimizer_states = _keep_step(cls._set_main_param_and_optimizer_states)
    cls.load_state_dict = _own_step_per_param(cls.load_state_dict)


def _fix_mla_te_check(module):
    """Without TE, megatron's TE extension module stands in a MagicMock for TE, so its `TELinear`
    is no class, yet multi_latent_attention's own import of it succeeds and sets HAVE_TE = True:
    building MLA then fails in `isinstance(self.linear_proj, TELinear)`."""
    from megatron.core.extensions import transformer_engine

    if not transformer_engine.HAVE_TE:
        module.HAVE_TE = False


class _SumGradientOverTensorParallel(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient over the tensor-parallel group.
    (megatron's copy_to_tensor_model_parallel_region does the same, but all-reduces a contiguous
    copy of a non-contiguous gradient and returns the original: the sum is lost.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _mla_rotary_key_gradient(module):
    """Megatron-LM issue #1699, open in 0.16.1: with a column-parallel linear_kv_down_proj (the local
    spec) and TP > 1, the down projection's output is all-gathered, then split into the latent and
    the rotary key. Every rank uses the whole rotary key with its own heads, so its gradient is a
    sum over the ranks, but the gather's backward only splits: the rotary key's weights got one
    rank's heads' gradient (tiny DeepSeek, TP2 + SP: gradient norm 5% off one process). The rotary
    channels of the gathered output now sum their gradient over TP; the layer marks its output
    with their count."""
    from megatron.core.parallel_state import get_tensor_model_parallel_group
    from megatron.core.tensor_parallel import ColumnParallelLinear

    gather, init = module.gather_from_tensor_model_parallel_region, module.MLASelfAttention.__init__
    column_parallel = tuple(c for c in (ColumnParallelLinear, module.TEColumnParallelLinear) if isinstance(c, type))

    @functools.wraps(gather)
    def gather_(input_, group=None):
        out = gather(input_, group)
        rotary = getattr(input_, "mla_rotary_channels", 0)
        if not rotary:
            return out
        latent, key = out.split([out.shape[-1] - rotary, rotary], dim=-1)
        key = _SumGradientOverTensorParallel.apply(key, group or get_tensor_model_parallel_group())
        return torch.cat([latent, key], dim=-1)

    def mark(channels, _layer, _inputs, output):
        output[0].mla_rotary_channels = channels

    @functools.wraps(init)
    def init_(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if isinstance(self.linear_kv_down_proj, column_parallel) and self.pg_collection.tp.size() > 1:
            self.linear_kv_down_proj.register_forward_hook(functools.partial(mark, self.config.qk_pos_emb_head_dim))

    module.gather_from_tensor_model_parallel_region = gather_
    module.MLASelfAttention.__init__ = init_


def _fix_router_gemm(module):
    """moe_utils uses `te_general_gemm is not None` in the router's linear, but never defines the
    name when TE is missing (NameError on every MoE forward)."""
    if not module.HAVE_TE and not hasattr(module, "te_general_gemm"):
        module.te_general_gemm = None


def _paged_attention_without_flash_attn(module):
    """The dynamic inference engine calls flash-attn's paged kernels (and asserts flash-attn >=
    2.7.3 is installed); without flash-attn, give it the torch versions in paged_attention.py."""
    if module.flash_attn_with_kvcache is not None:
        return
    from . import paged_attention

    module.flash_attn_varlen_func = paged_attention.flash_attn_varlen_func
    module.flash_attn_with_kvcache = paged_attention.flash_attn_with_kvcache
    module.is_fa_min_version = lambda *args, **kwargs: True  # only asked about the kernels above


def _kv_cache_index_under_vpp(module):
    """The dynamic inference context indexes its KV cache by a layer's place among the rank's
    layers (layer_number minus the stage's layer offset), and megatron asserts there is no virtual
    pipeline when it asks for that offset. Under a virtual pipeline a rank's layers are its chunks'
    layers in chunk order: the offset is the layer's chunk offset less the layers of the rank's
    earlier chunks (our engine runs the chunks in turn: rollout/engine.py)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset_without_vpp = module.Attention._get_pp_layer_offset_for_inference

    def offset(self):
        vpp = self.config.virtual_pipeline_model_parallel_size
        if vpp is None:
            return offset_without_vpp(self)
        pp_rank, earlier = module.get_pg_rank(self.pg_collection.pp), 0
        for vp_stage in range(vpp):
            start = get_transformer_layer_offset(self.config, vp_stage=vp_stage, pp_rank=pp_rank)
            count = get_num_layers_to_build(self.config, vp_stage=vp_stage, pp_rank=pp_rank)
            if start < self.layer_number <= start + count:
                return start - earlier
            earlier += count
        raise AssertionError(f"layer {self.layer_number} is in none of pipeline rank {pp_rank}'s chunks")

    module.Attention._get_pp_layer_offset_for_inference = offset


def _mamba_without_kernels(module):
    """megatron-core's Mamba layer binds mamba_ssm's Triton scans, its gated RMSNorm and
    causal_conv1d's kernels as module names (None, or a MagicMock base class, when absent), and
    refuses to build without mamba_ssm. Give it the torch versions with the same signatures
    (mamba_ops.py), and answer its version checks with the versions they stand in for."""
    if module.HAVE_MAMBA_SSM:
        return
    from packaging.version import Version

    from . import mamba_ops

    for name in ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "causal_conv1d_fn",
                 "causal_conv1d_update", "causal_conv1d_varlen_states", "selective_state_update", "RMSNormGated"):
        setattr(module, name, getattr(mamba_ops, name))

    class ExtendedRMSNorm(mamba_ops.RMSNormGated):
        """megatron's ExtendedRMSNorm (made on the MagicMock, so itself a MagicMock), on ours: the
        gated norm whose weight checkpoints sharded over TP along axis 0, as megatron's does."""

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            if not hasattr(self, "tp_group"):
                self.tp_group = module.parallel_state.get_tensor_model_parallel_group()
            return module.make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
                tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    module.ExtendedRMSNorm = ExtendedRMSNorm
    def min_version(ours):  # megatron's is_*_min_version(version, check_equality), asked of `ours`
        return lambda version, check_equality=True: (
            Version(ours) >= Version(version) if check_equality else Version(ours) > Version(version))

    module.is_mamba_min_version = min_version(mamba_ops.MAMBA_SSM_VERSION)
    module.is_causal_conv1d_min_version = min_version(mamba_ops.CAUSAL_CONV1D_VERSION)
    module.HAVE_MAMBA_SSM = True


def _short_chunk_conv_state(module):
    """Chunked prefill (a prompt longer than an engine step's token budget, continued over steps)
    stores the chunk's last d_conv inputs as the request's convolution state, zero-padded when the
    chunk is shorter than d_conv: the earlier chunk's inputs, which the next tokens' convolution
    still needs, are lost (a final chunk of 1 token leaves 3 zeros). Keep them: the state is the
    request's last d_conv inputs so far, whatever the chunk's length."""
    prefill = module.MambaMixer._ssm_prefill

    @functools.wraps(prefill)
    def fixed(self, zxBCdt, conv_state, ssm_state, *args, is_chunked_prefill=False, batch_indices=None, **kwargs):
        short = is_chunked_prefill and zxBCdt.shape[0] < self.d_conv
        before = conv_state[batch_indices].clone() if short else None
        y = prefill(self, zxBCdt, conv_state, ssm_state, *args, is_chunked_prefill=is_chunked_prefill,
                    batch_indices=batch_indices, **kwargs)
        if short:
            inner = self.cp.d_inner_local_tpcp
            xBC = zxBCdt[:, 0, inner:2 * inner + 2 * self.cp.ngroups_local_tpcp * self.d_state].T  # (channels, l)
            conv_state[batch_indices] = torch.cat([before, xBC[None].to(before.dtype)], dim=-1)[..., -self.d_conv:]
        return y

    module.MambaMixer._ssm_prefill = fixed


def _mamba_stack_final_norm(module):
    """MambaStack builds its final norm as TENorm, which raises without Transformer Engine; build
    the norm of our local spec there instead."""
    from megatron.core.extensions import transformer_engine

    if transformer_engine.HAVE_TE:
        return
    from megatron_rl.platform.norm import Norm

    module.TENorm = Norm


def _rotary_thd_without_host_reads(module):
    """megatron's rotary embedding of a packed row (THD) splits the row by `cu_seqlens.tolist()` and
    compares a tensor element with a size in an `if`: two reads of the device in every attention
    layer's forward, each a wait for the GPU (and no CUDA graph). Without context parallelism each
    token's frequencies are those of its position in its sample, found on the device (case 2 of
    megatron's; case 1, the frequencies of every position of the row, when there are as many of them
    as rows): the same numbers."""
    thd = module._apply_rotary_pos_emb_thd

    @functools.wraps(thd)
    def without_reads(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                      cp_group=None):
        from megatron_rl.platform.attention import packed_positions

        if cp_group is None or cp_group.size() > 1:
            return thd(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        if freqs.size(0) == t.shape[0]:
            rows = torch.arange(t.shape[0], device=t.device)
        else:
            rows = packed_positions(cu_seqlens, t.shape[0])[1].clamp(max=freqs.size(0) - 1)
        return module._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[rows], rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)

    module._apply_rotary_pos_emb_thd = without_reads


def _local_graphs_for_decode_only(module):
    """rollout.cuda_graphs builds the model with megatron's local CUDA graphs (cuda_graph_impl="local")
    for the engine's decode steps; but a layer with a graph manager then also captures and replays
    graphs of its training forward and backward (any call without an inference context), which
    assume fixed shapes and buffers that RL's varying microbatches do not have. Training stays eager."""
    decide = module.TransformerLayer._should_call_local_cudagraph

    @functools.wraps(decide)
    def decode_only(self, *args, **kwargs):
        return kwargs.get("inference_context") is not None and decide(self, *args, **kwargs)

    module.TransformerLayer._should_call_local_cudagraph = decode_only


def _results_queue_by_fork(module):
    """dist_checkpointing's writer hands its results back through a queue served by a Manager process
    it starts with 'spawn', which re-imports train.py, torch and megatron: about 2 s at every process's
    first save. Our saves are synchronous (the queue is filled and emptied in this process, as
    megatron's own forked writer processes are), so a forked Manager serves it, started in milliseconds."""
    import multiprocessing

    def results_queue():
        if module._results_queue is None:
            module._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return module._results_queue

    module._get_write_results_queue = results_queue


def _layer_wise_allgather_on_gloo(module):
    """megatron's layer-wise distributed optimizer (Muon's, optimizer.distributed) all-gathers each data-
    parallel rank's updated parameters, flattened, in one all_gather of unequal sizes: NCCL takes that,
    gloo (CPU) raises "invalid tensor size". On gloo each rank's flat parameters are padded to the
    longest and cut back after the gather; NCCL keeps megatron's own."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    allgather_params = module.LayerWiseDistributedOptimizer.allgather_params

    def gather(params_list, group):
        rank, sizes = dist.get_rank(group), [sum(p.numel() for p in params) for params in params_list]
        like = next(p for params in params_list for p in params)
        flat = torch.zeros(max(sizes), dtype=like.dtype, device=like.device)
        if params_list[rank]:
            flat[:sizes[rank]] = _flatten_dense_tensors(params_list[rank])
        gathered = [torch.empty_like(flat) for _ in params_list]
        dist.all_gather(gathered, flat, group=group)
        for i, (other, params) in enumerate(zip(gathered, params_list)):
            if i != rank and params:
                for new, param in zip(_unflatten_dense_tensors(other[:sizes[i]], params), params):
                    param.data.copy_(new)

    @functools.wraps(allgather_params)
    def padded(self):
        if self.pg_collection is None or dist.get_backend(self.pg_collection.dp_cp) != "gloo":
            return allgather_params(self)
        if self.dp_cp_params_list:
            gather(self.dp_cp_params_list, self.pg_collection.dp_cp)
        if self.expt_dp_params_list:
            gather(self.expt_dp_params_list, self.pg_collection.expt_dp)

    module.LayerWiseDistributedOptimizer.allgather_params = padded


def _layer_wise_fp32_checkpoint(module):
    """megatron's layer-wise optimizer edits each sub-optimizer's checkpoint dict as a mixed-precision
    optimizer's ({'optimizer': {'state', 'param_groups'}, 'fp32_from_fp16_params'}); an fp32 one's (its
    FP32Optimizer) is {'state', 'param_groups'}, and saving raised KeyError 'optimizer'. Its fp32
    sub-optimizers' dicts are put under 'optimizer' for the edit and taken out after it."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    sharded_state_dict = module.LayerWiseDistributedOptimizer.sharded_state_dict

    @functools.wraps(sharded_state_dict)
    def nested(self, model_sharded_state_dict, is_loading=False, **kwargs):
        fp32 = [i for i, o in enumerate(self.chained_optimizers) if isinstance(o, FP32Optimizer)]
        for i in fp32:
            own = self.chained_optimizers[i].sharded_state_dict
            self.chained_optimizers[i].sharded_state_dict = lambda *a, own=own, **k: {"optimizer": own(*a, **k)}
        try:
            out = sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)
        finally:
            for i in fp32:
                del self.chained_optimizers[i].sharded_state_dict
        if len(self.chained_optimizers) == 1:
            return out["optimizer"] if fp32 else out
        return {i: sd["optimizer"] if i in fp32 else sd for i, sd in out.items()}

    module.LayerWiseDistributedOptimizer.sharded_state_dict = nested


def apply():
    import importlib.util

    if importlib.util.find_spec("triton") is None:  # megatron's Mamba inference helpers import it at the top
        hooks.substitute("megatron.core.inference.contexts.attention_context.triton.tensor_ops",
                         "megatron_rl.platform.mamba_ops")
    # These import wandb only for optional inference metrics and timers we never send there: 0.75 s
    # of every process's start-up. Our own W&B logging imports it when it is switched on.
    for name in ("megatron.core.timers", "megatron.core.inference.contexts.dynamic_context",
                 "megatron.core.inference.engines.dynamic_engine"):
        hooks.hide(name, "wandb")
    hooks.on_import("megatron.core.dist_checkpointing.strategies.filesystem_async", _results_queue_by_fork)
    hooks.on_import("megatron.core.models.common.embeddings.rope_utils", _rotary_thd_without_host_reads)
    hooks.on_import("megatron.core.transformer.transformer_layer", _local_graphs_for_decode_only)
    hooks.on_import("megatron.core.ssm.mamba_mixer", _mamba_without_kernels)
    hooks.on_import("megatron.core.ssm.mamba_mixer", _short_chunk_conv_state)
    hooks.on_import("megatron.core.ssm.mamba_block", _mamba_stack_final_norm)
    hooks.on_import("megatron.core.optimizer.distrib_optimizer", _fix_distrib_optimizer)
    hooks.on_import("megatron.core.optimizer.layer_wise_optimizer", _layer_wise_allgather_on_gloo)
    hooks.on_import("megatron.core.optimizer.layer_wise_optimizer", _layer_wise_fp32_checkpoint)
    hooks.on_import("megatron.core.transformer.multi_latent_attention", _fix_mla_te_check)
    hooks.on_import("megatron.core.transformer.multi_latent_attention", _mla_rotary_key_gradient)
    hooks.on_import("megatron.core.transformer.moe.moe_utils", _fix_router_gemm)
    hooks.on_import("megatron.core.transformer.attention", _paged_attention_without_flash_attn)
    hooks.on_import("megatron.core.transformer.attention", _kv_cache_index_under_vpp)
