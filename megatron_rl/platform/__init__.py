"""Device and process-group setup: the only place in megatron-rl that knows about devices.

CUDA present -> cuda + nccl, one GPU per local rank. Otherwise cpu + gloo, with megatron-core's
hard-coded CUDA calls answered on CPU (see cpu.py). Launchers: torchrun (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_NODELIST), or a plain single process.
"""

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist


def has_cuda() -> bool:
    return torch.cuda.is_available()


# Before any megatron.core import anywhere, so every megatron module is patched as it loads.
from . import fixes as _fixes

_fixes.apply()
if not has_cuda():
    from . import cpu as _cpu

    _cpu.apply()


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the job, read from the launcher's environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "single"


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: 'gpu[003-005,010],cpu1' -> 'gpu003'."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise ValueError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, ranges = head.group(1), head.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def read_launch(env=os.environ) -> Launch:
    """torchrun's variables win over Slurm's; neither means one process."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)), launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = int(env.get("SLURM_JOB_ID", "0"))
        return Launch(
            rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT", 20000 + job % 10000)), launcher="slurm",
        )
    return Launch(master_port=int(env.get("MASTER_PORT", 29500)))


def device() -> torch.device:
    """The device this rank computes on."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(launch: Launch | None = None, timeout_minutes: int = 30) -> Launch:
    """Start torch.distributed (once) for this process; returns where it sits."""
    launch = launch or read_launch()
    if dist.is_initialized():
        return launch
    if has_cuda():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    from datetime import timedelta

    dist.init_process_group(
        backend="nccl" if has_cuda() else "gloo",
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank, world_size=launch.world_size,
        timeout=timedelta(minutes=timeout_minutes),
    )
    return launch


def init_model_parallel(tp=1, pp=1, vpp=None, cp=1, ep=1, etp=None, seed=1234):
    """Megatron's process groups and its model-parallel RNG tracker, seeded."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown():
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
