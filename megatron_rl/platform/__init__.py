"""Device and process-group setup: the only place in megatron-rl that knows about devices.

CUDA present -> cuda + nccl, one GPU per local rank. Otherwise cpu + gloo, with megatron-core's
hard-coded CUDA calls answered on CPU (see cpu.py). Launchers: torchrun (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_NODELIST), or a plain single process.
"""

import contextlib
import gc
import os
import re
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.config import UserError


def has_cuda() -> bool:
    return torch.cuda.is_available()


# Known warnings the user cannot act on, silenced here and only here (every other warning prints):
# megatron-core saying at import that it falls back to torch where Transformer Engine or apex is
# absent (the CPU, GPUs without the extras); its advice to set CUDA_DEVICE_MAX_CONNECTIONS, which
# check_cuda_connections gives where it applies (Ampere, Hopper; never the CPU); and torch
# deprecating collectives megatron-core calls (all_gather_into_tensor, reduce_scatter_tensor) and
# the ShardedTensor and load_state_dict its checkpoints use.
for _message, _module in ((r"Transformer Engine and Apex are not installed", r"megatron\.core"),
                          (r"Apex is not installed", r"megatron\.core"),
                          (r"Transformer Engine is not installed", r"megatron\.core"),
                          (r".*recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS", r"megatron\.core"),
                          (r"`torch\.distributed\.\w+` is deprecated", r"torch\.distributed"),
                          (r"Please use DTensor instead and we are deprecating ShardedTensor", r"torch\.distributed"),
                          (r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing")):
    warnings.filterwarnings("ignore", message=_message, module=_module + r"(\.|$)")

# A forked child (a reward worker, a checkpoint writer) never garbage-collects what it inherited: the
# parent's objects are frozen across each fork (gc.freeze: the child's collector ignores them, as Python's
# gc docs advise for fork without exec). Collecting them in the child ran their finalizers on state that
# did not survive the fork (the parent's other threads): after many runs in one process (the README's
# commands, tests/test_readme.py) reward workers segfaulted in the collector, each job then waited out its
# timeout and the run seemed to hang.
os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)

# Before any megatron.core import anywhere, so every megatron module is patched as it loads.
from . import fixes as _fixes

_fixes.apply()
if not has_cuda():
    from . import cpu as _cpu

    _cpu.apply()
else:
    # torch's cuDNN attention builds a cuDNN graph for every new shape (RL's microbatches and decode
    # batches change shape every step); its flash and memory-efficient kernels need none.
    torch.backends.cuda.enable_cudnn_sdp(False)


class LaunchError(UserError, ValueError):
    """The launcher's environment cannot start this job (one sentence for the user)."""


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the job, read from the launcher's environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "single"
    nodes: tuple = ()  # the job's hosts where the launcher says (Slurm)

    def describe(self) -> str:
        where = f" on {len(self.nodes)} node(s) ({', '.join(self.nodes[:4])}{', ...' if len(self.nodes) > 4 else ''})" \
            if self.nodes else ""
        return f"launch: {self.launcher}, {self.world_size} rank(s){where}, master {self.master_addr}:{self.master_port}"


def _split_top_level(text: str) -> list[str]:
    """'a[1-2,4],b' -> ['a[1-2,4]', 'b']: commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise LaunchError(f"cannot parse the Slurm nodelist {text!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise LaunchError(f"cannot parse the Slurm nodelist {text!r}: an unclosed bracket")
    return parts + [current]


def _expand_host(pattern: str, nodelist: str) -> list[str]:
    """'node[01-02]-ib' -> ['node01-ib', 'node02-ib']; several bracket groups multiply out."""
    if "[" not in pattern:
        if not pattern or "]" in pattern:
            raise LaunchError(f"cannot parse the Slurm nodelist {nodelist!r}: empty or stray ']' in {pattern!r}")
        return [pattern]
    head, rest = pattern.split("[", 1)
    ranges, tail = rest.split("]", 1)
    numbers = []
    for item in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise LaunchError(f"cannot parse the Slurm nodelist {nodelist!r}: {item!r} is not a number or a "
                              "rising range such as 001-004")
        lo, hi, width = int(m.group(1)), int(m.group(2) or m.group(1)), len(m.group(1))
        numbers += [str(i).zfill(width) for i in range(lo, hi + 1)]
    tails = _expand_host(tail, nodelist) if tail else [""]  # expanded once, not once per number
    return [head + n + t for n in numbers for t in tails]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a Slurm nodelist, in order: 'gpu[001-002,007],cpu1' -> gpu001, gpu002, gpu007,
    cpu1; suffixes and several ranges too ('node[01-02]-ib', 'r[1-2]n[1-2]'), as `scontrol show
    hostnames` prints them."""
    hosts = [h for part in _split_top_level(nodelist.strip()) for h in _expand_host(part.strip(), nodelist)]
    if not hosts:
        raise LaunchError(f"the Slurm nodelist {nodelist!r} names no host")
    return hosts


def read_launch(env=os.environ) -> Launch:
    """torchrun's variables win over Slurm's (torchrun inside an srun step sets them); neither means
    one process, which needs no port (init_distributed: two runs on one machine never collide)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(
            rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"), local_rank=_int(env, "LOCAL_RANK", 0),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500),
            launcher="torchrun")
    if "SLURM_PROCID" in env:
        missing = [k for k in ("SLURM_NTASKS", "SLURM_NODELIST") if k not in env]
        if missing:
            raise LaunchError(f"SLURM_PROCID is set but {' and '.join(missing)} not: launch each rank with srun "
                              "inside an allocation (sbatch or salloc), or unset SLURM_PROCID for a single process")
        nodes = tuple(expand_nodelist(env["SLURM_NODELIST"]))
        job = _int(env, "SLURM_JOB_ID", 0)
        return Launch(
            rank=_int(env, "SLURM_PROCID"), world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID", 0), master_addr=env.get("MASTER_ADDR") or nodes[0],
            master_port=_int(env, "MASTER_PORT", 20000 + job % 10000), launcher="slurm", nodes=nodes)
    return Launch()


def _int(env, key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None and default is not None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LaunchError(f"{key}={value!r} is not a whole number: fix the launcher's environment") from None


def free_port() -> int:
    """A TCP port no process listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_cuda_connections(tp: int, cp: int, env=os.environ) -> str | None:
    """The warning to print when tensor or context parallelism runs on Ampere or Hopper without
    CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron-core then cannot order its communication before the
    compute it overlaps with); None elsewhere (the CPU, Blackwell, where it should stay unset)."""
    if not has_cuda() or max(tp, cp) == 1 or env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return None
    major = torch.cuda.get_device_capability()[0]
    if major not in (8, 9):
        return None
    return (f"warning: CUDA_DEVICE_MAX_CONNECTIONS is not 1 with tp={tp} cp={cp} on compute capability {major}.x "
            "(Ampere/Hopper): communication overlap suffers; export CUDA_DEVICE_MAX_CONNECTIONS=1 (slurm/env.sh does)")


@dataclass(frozen=True)
class DeviceTraits:
    """What the rest of the code asks about the device this rank computes on, answered here only."""

    cuda: bool  # a CUDA GPU: NCCL, bf16 by default, CUDA graphs, nvtx and nsys, Transformer Engine
    device: torch.device

    @property
    def default_precision(self) -> str:
        """train.precision=auto: bf16 on a GPU, fp32 on the CPU (whose bf16 GEMMs are slow and inexact)."""
        return "bf16" if self.cuda else "fp32"


def traits() -> DeviceTraits:
    return DeviceTraits(has_cuda(), device())


def device_rng_state() -> dict:
    """The device's own random state beyond torch's CPU generator (the CUDA generator), for a checkpoint."""
    return {"cuda": torch.cuda.get_rng_state()} if has_cuda() else {}


def set_device_rng_state(state: dict) -> None:
    if "cuda" in state and has_cuda():
        torch.cuda.set_rng_state(state["cuda"])


def weights_unchanged():
    """A stretch in which no weight changes (a rollout; one step's forward and backward): on the CPU,
    oneDNN then reorders each weight once for the stretch instead of inside every GEMM (platform/cpu.py
    packed_weights); on a GPU nothing (platform/cpu.py is not even imported there)."""
    return contextlib.nullcontext() if has_cuda() else _cpu.packed_weights()


def set_training_length(seq_length: int) -> None:
    """The training sequence length (data.seq_length), which CPU attention of long sequences runs over so
    that rollouts agree with training bit for bit (platform/attention.py ONE_PASS_KEYS)."""
    from . import attention

    attention.training_keys = seq_length


def device() -> torch.device:
    """The device this rank computes on."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return _cpu.CPU  # the one object megatron's torch.cuda.current_device() answers (syncs.py tells it from the host)


def init_distributed(launch: Launch | None = None, timeout_minutes: int = 30, rollout_ranks: int = 0) -> Launch:
    """Start torch.distributed (once) for this process; returns where it sits. rollout_ranks > 0 splits
    the job (platform/bridge.py): the default process group is then this rank's side's."""
    launch = launch or read_launch()
    if dist.is_initialized():
        return launch
    if has_cuda():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    from datetime import timedelta

    # On GPUs, NCCL for CUDA tensors and gloo for the CPU tensors that metrics and flags use (a plain
    # "nccl" group refuses a CPU tensor: "No backend type associated with device type cpu").
    backend = "cpu:gloo,cuda:nccl" if has_cuda() else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if launch.world_size == 1:  # nothing to meet: a store in memory, so one-process runs never compete for a port
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return launch
    try:
        if rollout_ranks:
            from .bridge import init_split

            # the store init_process_group would make (torchrun's agent's, where it hosts one)
            store, _, _ = next(dist.rendezvous(f"tcp://{launch.master_addr}:{launch.master_port}", launch.rank,
                                               launch.world_size, timeout=timeout))
            init_split(store, launch.rank, launch.world_size, rollout_ranks, backend, timeout)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                                    rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    except dist.DistNetworkError as e:
        if "address already in use" not in str(e).lower():
            raise
        raise LaunchError(f"the master port {launch.master_port} on {launch.master_addr} is already in use (another "
                          "run on this machine?): set MASTER_PORT to a free port") from None
    return launch


PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")  # a scheduler's notice (Slurm: sbatch --signal=USR1@300)
_preempted = []  # the signals this process got


def watch_preemption():
    """From now on SIGTERM and SIGUSR1 do not kill this process: they ask the run to stop after its
    current step (preemption_requested), save and exit 0, so that a requeued job resumes. Ctrl-C
    (SIGINT) asks the same, saying so, and the run exits 130 once saved; a second Ctrl-C stops at once
    (exit 130, nothing saved). torchrun forwards the terminal's SIGINT to ranks that got it already:
    one within a second of the first is the same keystroke."""
    import signal
    import time

    main = os.getpid()

    def handler(signum, _frame):
        if os.getpid() != main:  # a forked child (a reward worker, which Pool.terminate ends by SIGTERM): die;
            if signum != signal.SIGINT:  # the terminal's Ctrl-C reaches it too, and is its parent's to handle
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT:
            if _interrupts and time.monotonic() - _interrupts[-1] > 1.0:
                _say("\ninterrupted again: stopping now, without saving")
                os._exit(130)
            if not _interrupts:
                _say("\ninterrupted: stopping after this step and saving a checkpoint (Ctrl-C again stops at once)")
            _interrupts.append(time.monotonic())
        _preempted.append(signum)

    for name in (*PREEMPTION_SIGNALS, "SIGINT"):
        signal.signal(getattr(signal, name), handler)


_interrupts = []  # when this process got SIGINT


def signals_received() -> list[int]:
    """The preemption signals (and Ctrl-C) this process got so far."""
    return list(_preempted)


def pass_on_preemption(signals: list[int]) -> None:
    """Signals another process got count as this one's (a generation rank's, which never asks
    preemption_requested itself: the training ranks stop, save, and stop it)."""
    _preempted.extend(signals)


def interrupted() -> bool:
    """Whether Ctrl-C (SIGINT) stopped this run (it exits 130)."""
    return bool(_interrupts)


def _say(line: str):
    if os.environ.get("RANK", "0") == "0":
        os.write(2, (line + "\n").encode())  # a signal handler: no buffered stream, which may be mid-write


def tie_process_lifetimes():
    """A killed run leaves no process behind to train on, write into a checkpoint or wait on a queue
    forever. Under torchrun this process dies with its agent (kill -9 of torchrun ends every rank),
    and every process forked from now on (reward workers, dist_checkpointing's writers) dies with the
    process that forked it, SIGKILL included. (Linux's PR_SET_PDEATHSIG; elsewhere a no-op. Not for
    a plain `python train.py`, whose parent is a shell it may be meant to outlive.)"""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)

    def follow(parent: int):
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl: follow it now
            os._exit(1)

    if "TORCHELASTIC_RUN_ID" in os.environ:
        follow(os.getppid())
    forker = [0]
    os.register_at_fork(before=lambda: forker.__setitem__(0, os.getpid()), after_in_child=lambda: follow(forker[0]))


def keep_freed_memory() -> None:
    """On a CPU run, memory that the process frees stays with it (glibc: no heap trimming, no mmap for
    large blocks). By default glibc gives large blocks back to the kernel when they are freed, and
    every training step's activations (megabytes each, their sizes changing with each microbatch)
    then come from pages the kernel must fault in and zero again: tens of thousands of page faults a
    step. Peak memory is unchanged; the process just keeps it. A no-op with CUDA or without glibc."""
    import ctypes
    import sys

    if has_cuda() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)  # the C library the process runs on, as tie_process_lifetimes loads it
    if not hasattr(libc, "mallopt"):  # musl and others
        return
    libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD: never (size_t -1)
    libc.mallopt(-4, 0)  # M_MMAP_MAX: no block of its own for large allocations


def preemption_requested() -> bool:
    """Whether a preemption signal reached any rank: a collective (every rank asks at the end of the
    same step), so that all stop together."""
    import faulthandler
    import signal

    for name in PREEMPTION_SIGNALS:  # megatron's inference module chains a stack dump to SIGTERM: not ours
        faulthandler.unregister(getattr(signal, name))
    return any_rank(_preempted)


def any_rank(flag: bool, group=None) -> bool:
    """Whether `flag` holds on any rank of `group` (default: all): a collective every rank calls."""
    t = torch.tensor([float(bool(flag))])  # a CPU tensor: gloo carries it, with no device sync
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def init_model_parallel(tp=1, pp=1, vpp=None, cp=1, ep=1, etp=None, seed=1234, cuda_graphs=False):
    """Megatron's process groups and its model-parallel RNG tracker, seeded; one that CUDA graphs can
    capture where the rollout's decode runs in them (cuda_graphs, on CUDA: megatron's graph manager
    refuses another)."""
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
    graphs = cuda_graphs and has_cuda()
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graphs, force_reset_rng=graphs)


def use_batch_invariant_kernels() -> None:
    """From now on megatron-core's batch-invariant kernels (Triton, CUDA) replace torch's matmul,
    log_softmax and mean (rollout.batch_invariant, for the whole run: rollouts and training; support.py
    checks the machine)."""
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import enable_batch_invariant_mode

    enable_batch_invariant_mode()


def shutdown():
    from megatron.core import parallel_state

    from megatron_rl.platform import watchdog

    from . import bridge

    watchdog.stop()  # before the store goes away
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    bridge.leave()
