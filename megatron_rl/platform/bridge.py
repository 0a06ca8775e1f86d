"""Disaggregated jobs (parallel.rollout_ranks=R): one SPMD program whose last R ranks only generate.

Each side gets a torch.distributed world of its own, so every collective the code already makes
(megatron's parallel_state, barriers, metrics) stays on its side unchanged: `init_split` makes the
default process group the side's, on a prefix of the launcher's store, and the *bridge*, a gloo group
over all ranks, which carries what crosses between the sides (commands, rollouts, weights) as CPU
tensors. The bridge is not a torch.distributed group (it is not a subgroup of the side's world): use
its methods. The job's store, over all ranks, is what the watchdog watches.
"""

import io
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Side:
    """Where this rank sits in a disaggregated job."""

    name: str  # "train" or "rollout"
    rank: int  # in the whole job
    first: int  # the job rank of this side's first rank
    size: int  # this side's ranks
    world_size: int  # the whole job's ranks
    trainers: int  # ranks that train (the first ones)


class Bridge:
    """Collectives over every rank of the job, both sides (a gloo group of CPU tensors)."""

    def __init__(self, group, side: Side):
        self.group, self.side = group, side

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`tensor` (a CPU tensor, the same shape everywhere) from job rank `src`, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def broadcast_object(self, obj, src: int):
        """Any picklable object (tensors in it included) from job rank `src`; every rank gets it."""
        if self.side.rank == src:
            buffer = io.BytesIO()
            torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
            data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.broadcast(size, src)
        if self.side.rank != src:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.broadcast(data, src)
        if self.side.rank == src:
            return obj
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)

    def broadcast_tensors(self, tensors: dict | None, src: int) -> dict:
        """{name: CPU tensor} from job rank `src`: their names, shapes and dtypes as one object, then one flat
        buffer per dtype (no pickling of the data); every rank gets the dict (views into the buffers)."""
        meta = self.broadcast_object([(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
                                     if self.side.rank == src else None, src)
        out = {}
        for dtype in sorted({d for _, _, d in meta}, key=str):
            names = [(k, shape) for k, shape, d in meta if d == dtype]
            if self.side.rank == src:
                flat = torch.cat([tensors[k].reshape(-1) for k, _ in names])
            else:
                flat = torch.empty(sum(torch.Size(shape).numel() for _, shape in names), dtype=dtype)
            self.broadcast(flat.view(torch.uint8), src)  # bytes: gloo carries any dtype so
            for (k, shape), part in zip(names, flat.split([torch.Size(s).numel() for _, s in names])):
                out[k] = part.view(shape)
        return out

    def barrier(self):
        self.group.barrier().wait()


_split: dict = {}  # "side", "bridge", "store" while a job is split


def init_split(store, rank: int, world_size: int, rollout_ranks: int, backend: str, timeout: timedelta) -> Side:
    """This rank's side's world as the default process group, and the bridge over all ranks."""
    trainers = world_size - rollout_ranks
    first, size, name = (0, trainers, "train") if rank < trainers else (trainers, rollout_ranks, "rollout")
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"{name}/", store), rank=rank - first,
                            world_size=size, timeout=timeout)
    side = Side(name, rank, first, size, world_size, trainers)
    group = dist.ProcessGroupGloo(dist.PrefixStore("bridge/", store), rank, world_size, timeout)
    _split.update(side=side, bridge=Bridge(group, side), store=store)
    return side


def side() -> Side | None:
    """This rank's side of a disaggregated job; None when every rank does everything."""
    return _split.get("side")


def bridge() -> Bridge:
    return _split["bridge"]


def job_store():
    """The store of the whole job (both sides), or None when the job is not split."""
    return _split.get("store")


def leave():
    _split.clear()
