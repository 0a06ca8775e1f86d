"""Counting host synchronizations: the places where the host waits for the device.

A GPU runs ahead of the Python that launches its kernels until the host needs a value the device
computes (`.item()`, `if tensor:`, a shape that depends on data such as `nonzero()`, a copy to the
CPU): then it waits for all queued work, and the GPU idles while Python catches up. A model
forward with such a read cannot be captured in a CUDA graph either. So hot paths are written
without them, and tests hold them to a budget (tests/test_syncs.py).

`counting()` counts them in a region. With CUDA: every synchronization CUDA itself reports
(torch.cuda.set_sync_debug_mode). On the CPU, where nothing ever waits, the operations that
would synchronize if the tensors were on a GPU, which inside a model's forward they all are:
reads of a value (`item`, `bool`/`int`/`float` of a tensor, `tolist`, `equal`), copies to the
host (`cpu`, `numpy`, `to("cpu")`), and operations whose output size depends on the data
(`nonzero`, `unique`, `masked_select`, boolean-mask indexing, `repeat_interleave` without
`output_size`, `bincount`). Aten-level operations are counted in backward passes too; the
Python-level ones (`cpu`, `tolist`, `numpy`, which never reach aten for a CPU tensor) in forward
code only.
"""

import contextlib
import traceback
import warnings
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import cpu

_aten = torch.ops.aten

# Operations that read device memory on the host, or size their output by the data they hold.
_READS = {_aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default, _aten.equal.default,
          _aten.allclose.default, _aten.nonzero.default, _aten.argwhere.default, _aten._unique.default,
          _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
          _aten.masked_select.default, _aten.bincount.default}
_REPEATS = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
_HOST_COPIES = {"cpu", "tolist", "numpy", "__array__"}


def _mask_index(indices) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _synchronizes(func, args, kwargs) -> bool:
    """Whether this aten call would make the host wait on a GPU."""
    if func in _READS:
        return True
    if func in _REPEATS:
        return kwargs.get("output_size", args[-1] if len(args) > 2 else None) is None
    if func in _INDEXING:
        return _mask_index(args[1])
    return False


def _copies_to_host(name: str, args, kwargs) -> bool:
    """Whether this Python-level tensor call copies to the host (on a CPU tensor, no aten call does).
    A copy to platform.device() is none: on the CPU that is the compute device (cpu.CPU), not the host."""
    if name in _HOST_COPIES:
        return True
    if name == "to":
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return (isinstance(target, (str, torch.device)) and target is not cpu.CPU
                and torch.device(target).type == "cpu")
    return False


def _where() -> str:
    """The first frame outside torch and this module: the code that asked."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename
        if "/torch/" not in path and not path.endswith(("syncs.py", "/warnings.py")):
            short = path.split("site-packages/")[-1]
            return f"{short}:{frame.lineno} ({frame.name})"
    return "?"


class Syncs:
    """What `counting()` saw: `count` in all, and `where` (Counter of 'op at file:line (function)')."""

    def __init__(self, host=()):
        self.where = Counter()
        self.active = True  # off between the forwards of `inside` modules
        self.host = {id(t) for t in host}  # tensors that live on the host on a GPU too: reading them is free

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def add(self, op: str):
        if self.active:
            self.where[f"{op} at {_where()}"] += 1

    def report(self, top: int = 20) -> str:
        return "\n".join(f"{n:6d}  {what}" for what, n in self.where.most_common(top))


class _Reads(TorchDispatchMode):
    def __init__(self, syncs: Syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _synchronizes(func, args, kwargs) and not (args and id(args[0]) in self.syncs.host):
            self.syncs.add(func.__name__)
        return func(*args, **kwargs)


class _Copies(TorchFunctionMode):
    def __init__(self, syncs: Syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_COPIES or name == "to":
            if _copies_to_host(name, args, kwargs):
                self.syncs.add(name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _toggled_by(syncs: Syncs, modules):
    """Count only while one of `modules` runs its forward."""
    if not modules:
        yield
        return
    depth = [0]

    def enter(*_):
        depth[0] += 1
        syncs.active = True

    def leave(*_):
        depth[0] -= 1
        syncs.active = depth[0] > 0

    syncs.active = False
    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def counting(inside: list | None = None, cuda: bool | None = None, host=()):
    """Count host synchronizations in the block (Syncs); inside: only during these modules' forwards.
    cuda (default: whether CUDA is available): count what CUDA reports rather than the CPU's rules.
    host: tensors that stay on the host on a GPU too (torch Adam's step counts): reads of them are
    not counted on the CPU."""
    syncs = Syncs(host)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    with _toggled_by(syncs, inside):
        if cuda:
            with _cuda_reports(syncs):
                yield syncs
        else:
            with _Reads(syncs), _Copies(syncs):
                yield syncs


@contextlib.contextmanager
def _cuda_reports(syncs: Syncs):
    """CUDA's own account: with sync debug mode on, every synchronizing call warns."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, *rest):
            if "synchronizing" in str(message):
                syncs.add("cuda sync")
            else:
                shown(message, category, filename, lineno, *rest)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
