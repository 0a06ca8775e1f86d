"""Make megatron-core 0.16.1 run on a machine without CUDA.

megatron-core hard-codes CUDA: ``device="cuda"`` literals, ``torch.cuda.current_device()``
used as a device, ``torch.cuda.synchronize``/streams/events, CUDA RNG state, ``.cuda()`` and
``pin_memory=True``. Rather than a global ``TorchFunctionMode`` (thread-local, so absent in
autograd backward, and 7-64% overhead on every op), each megatron module sees a stand-in
``torch`` whose factories map cuda devices to cpu and whose ``torch.cuda`` answers on CPU.
Compute ops are the real torch functions, untouched, so the hot path pays nothing.
Nothing here is applied when CUDA is available.
"""

import contextlib
import functools
import inspect
import logging
import types

import torch

from . import hooks

CPU = torch.device("cpu")


def _cpu_device(device):
    """Map any cuda device spec (str, int, torch.device) to cpu; leave others alone."""
    if device is None:
        return None
    if isinstance(device, int):  # megatron passes torch.cuda.current_device() ints
        return CPU
    if isinstance(device, str):
        return CPU if device.startswith("cuda") else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


def _on_cpu(fn):
    """Wrap a torch factory so cuda devices and pinned memory become plain cpu tensors."""

    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA driver
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__wrapped__ = fn
    return wrapper


_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "linspace",
    "eye", "tril_indices", "triu_indices", "empty_strided", "Generator",
)


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is synchronous, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        self.device = CPU

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *a, **k): pass
    def wait_event(self, *a, **k): pass
    def record_event(self, *a, **k): return _NullStream()
    def record(self, *a, **k): pass
    def synchronize(self): pass
    def query(self): return True
    def wait(self, *a, **k): pass
    def elapsed_time(self, other): return 0.0


def _noop(*args, **kwargs):
    return None


class _Nvtx(types.SimpleNamespace):
    pass


def _make_cuda_namespace():
    real = torch.cuda
    ns = types.ModuleType("torch.cuda(cpu)")
    ns.__getattr__ = lambda name: getattr(real, name)  # anything not overridden: the real one
    overrides = dict(
        is_available=lambda: False,
        current_device=lambda: CPU,
        device_count=lambda: 1,
        set_device=_noop,
        synchronize=_noop,
        empty_cache=_noop,
        Stream=_NullStream,
        Event=_NullStream,
        stream=lambda s=None: contextlib.nullcontext(),
        current_stream=lambda *a, **k: _NullStream(),
        default_stream=lambda *a, **k: _NullStream(),
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed),
        manual_seed_all=lambda seed: torch.manual_seed(seed),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        memory_reserved=lambda *a, **k: 0,
        max_memory_reserved=lambda *a, **k: 0,
        reset_peak_memory_stats=_noop,
        memory_stats=lambda *a, **k: {},
        mem_get_info=lambda *a, **k: (0, 0),
        get_device_properties=lambda *a, **k: types.SimpleNamespace(
            name="cpu", total_memory=0, multi_processor_count=1, major=0, minor=0),
        get_device_capability=lambda *a, **k: (0, 0),
        nvtx=_Nvtx(range_push=_noop, range_pop=_noop, mark=_noop,
                   range=lambda *a, **k: contextlib.nullcontext()),
    )
    for name, value in overrides.items():
        setattr(ns, name, value)
    return ns


def _make_torch_namespace():
    """A module that is torch, except for cuda-aware factories and torch.cuda."""
    ns = types.ModuleType("torch(cpu)")
    ns.__dict__.update({k: v for k, v in torch.__dict__.items() if not k.startswith("__")})
    ns.__getattr__ = lambda name: getattr(torch, name)  # submodules imported after us
    for name in _FACTORIES:
        setattr(ns, name, _on_cpu(getattr(torch, name)))
    ns.device = _device_on_cpu
    ns.cuda = _make_cuda_namespace()
    return ns


class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.device)


class _device_on_cpu(metaclass=_DeviceMeta):
    """torch.device that turns 'cuda'/'cuda:N' into cpu; isinstance checks still work."""

    def __new__(cls, type_or_str, index=None):
        if isinstance(type_or_str, str) and type_or_str.startswith("cuda"):
            return CPU
        return torch.device(type_or_str) if index is None else torch.device(type_or_str, index)


CPU_TORCH = None  # the stand-in torch, made once by apply()


def _patch_module(module):
    """Point one megatron module's `torch` global at the CPU stand-in."""
    if getattr(module, "torch", None) is torch:
        module.torch = CPU_TORCH


def _cpu_rng_get(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_rng_set(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


_real_tensor_type = torch.Tensor.type


def _type_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
    """Tensor.type() that names a cpu tensor as its cuda twin ('torch.FloatTensor' -> 'torch.cuda.FloatTensor')."""
    if dtype is not None:
        return _real_tensor_type(self, dtype, non_blocking, **kwargs)
    name = _real_tensor_type(self)
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


def _cuda_type_names(fn):
    """Run fn while Tensor.type() reports cuda names: megatron checks parameter and gradient
    types with `t.type() == 'torch.cuda.FloatTensor'` and refuses cpu tensors otherwise."""

    def wrapper(*args, **kwargs):
        torch.Tensor.type = _type_as_cuda
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = _real_tensor_type

    wrapper.__wrapped__ = fn
    return wrapper


def _patch_clip_grads(module):
    module.clip_grad_by_total_norm_fp32 = _cuda_type_names(module.clip_grad_by_total_norm_fp32)


def _patch_optimizer(module):
    from megatron.core.optimizer import clip_grads

    module.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32  # imported by name
    cls = module.Float16OptimizerWithFloat16Params  # bf16: sorts parameters by their type() name
    cls.__init__ = _cuda_type_names(cls.__init__)


def _patch_distrib_optimizer(module):
    cls = module.DistributedOptimizer  # sorts parameters by their type() name
    cls.__init__ = _cuda_type_names(cls.__init__)


def _patch_random(module):
    # The model-parallel RNG tracker reads/writes torch.cuda.default_generators directly;
    # on CPU the one generator is the CPU default generator.
    module._get_cuda_rng_state = _cpu_rng_get
    module._set_cuda_rng_state = _cpu_rng_set
    # So every random draw inside the tracker's fork (the Mamba layer initializes there) changes
    # "the CPU state" and the tracker logs that as a problem, once per draw: expected here.
    logging.getLogger(module.__name__).addFilter(
        lambda record: record.getMessage() != "CPU RNG state changed within GPU RNG context")


def _patch_inference_communication(module):
    # Pipeline-parallel inference asserts that the tensors it sends between stages are CUDA tensors.
    module._is_cuda = lambda tensor: None


def _patch_dynamic_engine(module):
    # It imported torch.cuda.nvtx's range_push/range_pop by name; a CPU build of torch raises there.
    module.range_push = module.range_pop = _noop


def _split_sizes_on_host(tensor, as_numpy=False, record_stream=False):
    """moe_utils.maybe_move_tensor_to_cpu, also for tensors already on the CPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def has_onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x, weight):
    """x @ weight.t() by oneDNN (weight: (out, in)); a parameter (or its transpose) in oneDNN's own
    layout while packed_weights() is active, for products of 2 rows or more: those give the plain
    weight's results to the bit, where a single row (an MoE expert given one token) may not."""
    if _packs is not None and x.numel() >= 2 * x.shape[-1] > 0:
        weight = _blocked_layout(weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


_packs = None  # while packed_weights() is active: {(id(parameter), transposed): (parameter, its oneDNN layout)}


@contextlib.contextmanager
def packed_weights():
    """Within, oneDNN's linear GEMMs take each parameter (or its transpose) in oneDNN's blocked layout,
    reordered on its first use, rather than reordering the plain weight inside every call. For a
    stretch in which no weight changes (a rollout; one step's forward and backward); what was
    reordered is dropped on exit. The products are the same to the bit (tests/test_platform.py); on
    this machine's AMD EPYC a decode step's 64-row GEMMs take 0.85x as long and 8-row ones (a
    rollout's last requests) 0.45x, training's 1024-row forward 0.9x and its input gradient 0.95x."""
    global _packs
    if _packs is not None or not has_onednn_linear():
        yield
        return
    _packs = {}
    try:
        yield
    finally:
        _packs = None


def _blocked_layout(weight):
    """weight, if it is a parameter or a parameter's transpose, in oneDNN's layout (reordered once per
    packed_weights()); anything else as it is."""
    param = weight if isinstance(weight, torch.nn.Parameter) else weight._base
    if not isinstance(param, torch.nn.Parameter) or weight.dtype != torch.float32:
        return weight
    if weight.data_ptr() != param.data_ptr() or weight.dim() != 2:
        return weight
    if weight.shape == param.shape and weight.stride() == param.stride():
        transposed = False
    elif weight.shape == param.shape[::-1] and weight.stride() == param.stride()[::-1]:
        transposed = True
    else:
        return weight
    key = (id(param), transposed)
    if key not in _packs:
        plain = param.detach()
        _packs[key] = (param, torch.ops.mkldnn._reorder_linear_weight(plain.t() if transposed else plain, 64))
    return _packs[key][1]


def _onednn_linear_matmul(a, b, **kwargs):
    """torch.matmul, except that `input @ weight.t()` in fp32 runs as oneDNN's linear."""
    if not kwargs and b.dim() == 2 and b.stride(0) == 1 and a.dtype == b.dtype == torch.float32:
        return onednn_linear(a, b.t())
    return torch.matmul(a, b, **kwargs)


def _patch_linear_gemm(module):
    # The linear layers' forward GEMM (`torch.matmul(input, weight.t())`, in training and in
    # rollouts alike) runs on oneDNN rather than MKL: on this machine's AMD EPYC MKL's sgemm takes
    # 1.4x as long at 4096 rows and 1.5-1.8x at 64 (decode), and MKL sums the rows of 1-3- and
    # 5-row calls in another order than of larger ones, where oneDNN gives every row the same
    # result whatever the row count (1 excepted; the engine pads each step to 8 rows). That is
    # what keeps rollout logprobs equal to training logprobs. For the backward's, see
    # _onednn_backward_class.
    if not has_onednn_linear():
        return
    namespace = types.ModuleType("torch(cpu, onednn linear)")
    namespace.__dict__.update(module.torch.__dict__)
    namespace.matmul = _onednn_linear_matmul
    module.torch = namespace


def _onednn_backward_class(module):
    # The linear layers' backward GEMMs (megatron's `grad_output.matmul(weight)` and
    # `grad_output.t().matmul(input)`, tensor methods that a stand-in torch cannot reach) run on
    # oneDNN as the forward does: MKL's sgemm takes about 2.1x as long at training's 1024 rows on
    # this machine's AMD EPYC (measured 2026-12-05 on the shapes of bench/grpo_vs_trl.py), where
    # they were over half of a GRPO training step. The forward is megatron's own; the backward
    # covers megatron's plain case (no sequence parallelism, no fused gradient accumulation, no
    # deferred weight gradients), which linear_ routes here: the rest goes to megatron's Function.
    class OneDNNBackwardLinear(module.LinearWithGradAccumulationAndAsyncCommunication):
        @staticmethod
        def backward(ctx, grad_output):
            input, weight = ctx.saved_tensors
            g = grad_output.reshape(-1, grad_output.shape[-1])
            grad_input = onednn_linear(g, weight.t()).view(*grad_output.shape[:-1], weight.shape[1])
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True) \
                if ctx.allreduce_dgrad else None
            # an expert that got no tokens: oneDNN refuses a product over zero rows
            grad_weight = onednn_linear(g.t(), input.reshape(-1, input.shape[-1]).t()) if len(g) else \
                torch.zeros_like(weight)
            grad_bias = g.sum(dim=0) if ctx.use_bias else None
            if handle is not None:
                handle.wait()
            return grad_input, grad_weight, grad_bias, None, None, None, None, None, None

    return OneDNNBackwardLinear


def _patch_tensor_parallel_layers(module):
    _patch_linear_gemm(module)
    _skip_autograd_functions_in_inference(module)


def _skip_autograd_functions_in_inference(module):
    # The linear layers and the tensor-parallel copy and reduce go through torch.autograd.Function
    # even under torch.inference_mode, where nothing is recorded: 30-60 us of dispatch a call on
    # CPU, about 3 ms of a 90 ms decode step (33 linears, 26 copies and reduces). In inference mode
    # (rollouts) call their forwards' arithmetic directly, the same calls in the same order, so
    # rollout and training still round alike; with sequence parallelism (an all-gather first)
    # nothing changes. Outside inference mode, megatron's plain case runs its backward on oneDNN
    # (_onednn_backward_class).
    linear, copy, reduce = (module.linear_with_grad_accumulation_and_async_allreduce,
                            module.copy_to_tensor_model_parallel_region, module.reduce_from_tensor_model_parallel_region)
    from megatron.core.tensor_parallel import mappings
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    signature = inspect.signature(linear)
    onednn_backward = _onednn_backward_class(module) if has_onednn_linear() else None

    @functools.wraps(linear)
    def linear_(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, *args, **kwargs):
        if not sequence_parallel and torch.is_inference_mode_enabled():
            output = module.torch.matmul(input, weight.t())
            return output if bias is None else output + bias
        if onednn_backward is not None and not (sequence_parallel or gradient_accumulation_fusion) and \
                input.dtype == weight.dtype == torch.float32:
            given = signature.bind(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                   sequence_parallel, *args, **kwargs).arguments
            if given.get("grad_output_buffer") is None:
                return onednn_backward.apply(input, weight, bias, False, allreduce_dgrad, False, None, 0,
                                             get_tensor_model_parallel_group_if_none(given.get("tp_group")))
        return linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                      *args, **kwargs)

    @functools.wraps(copy)
    def copy_(input_, group=None):
        return input_ if torch.is_inference_mode_enabled() else copy(input_, group)

    @functools.wraps(reduce)
    def reduce_(input_, group=None):
        if not torch.is_inference_mode_enabled():
            return reduce(input_, group)
        return mappings._reduce(input_, get_tensor_model_parallel_group_if_none(group))

    module.linear_with_grad_accumulation_and_async_allreduce = linear_
    module.copy_to_tensor_model_parallel_region = copy_
    module.reduce_from_tensor_model_parallel_region = reduce_


def _patch_token_dispatcher(module):
    # The alltoall dispatcher gets its all_to_all split sizes from maybe_move_tensor_to_cpu(...,
    # as_numpy=True), which converts only CUDA tensors: on CPU the torch tensors reach
    # all_to_all_single, whose split sizes must be a sequence of ints (TypeError). Without this,
    # tests/test_sft.py::test_moe_expert_parallel_matches_single_process fails.
    module.maybe_move_tensor_to_cpu = _split_sizes_on_host


# The few places where a stand-in torch is not enough.
_SPECIALS = {
    "megatron.core.optimizer.clip_grads": _patch_clip_grads,
    "megatron.core.optimizer.optimizer": _patch_optimizer,
    "megatron.core.optimizer.distrib_optimizer": _patch_distrib_optimizer,
    "megatron.core.tensor_parallel.random": _patch_random,
    "megatron.core.inference.engines.dynamic_engine": _patch_dynamic_engine,
    "megatron.core.inference.communication_utils": _patch_inference_communication,
    "megatron.core.transformer.moe.token_dispatcher": _patch_token_dispatcher,
    "megatron.core.tensor_parallel.layers": _patch_tensor_parallel_layers,
}


_applied = False


def apply():
    """Install the CPU stand-ins for megatron-core. Idempotent; a no-op once applied."""
    global CPU_TORCH, _applied
    if _applied:
        return
    CPU_TORCH = _make_torch_namespace()
    # `.cuda()` on a tensor: megatron moves buffers with it; on CPU that is the identity.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    # megatron decorates its fusable helpers with torch.compile at import, which imports dynamo (about
    # 2 s of every process's start-up); on a CPU a compiled helper would recompile for every new
    # token count of a rollout. Its own switch makes them plain functions.
    hooks.on_import("megatron.core.jit", lambda jit: jit.disable_jit_fuser())
    hooks.on_every_import(_patch_module)
    for name, fn in _SPECIALS.items():
        hooks.on_import(name, fn)
    _applied = True
