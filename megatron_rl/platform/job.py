"""A train.py job's life on one rank: `start` brings up what every run needs (process groups, the
model-parallel layout, the thread count, preemption and lifetime handling, the watchdog), and `finish`
runs the algorithm and turns how it ended into an exit code, the same way on every rank."""

import os
import shutil
import sys
import traceback
from pathlib import Path

import torch

from megatron_rl.config import Config, UserError

from . import (Launch, check_cuda_connections, init_distributed, init_model_parallel, interrupted, keep_freed_memory,
               shutdown, tie_process_lifetimes, use_batch_invariant_kernels, watch_preemption, watchdog)


class RunStopped(RuntimeError):
    """A run that stops on purpose at the same step on every rank (it diverged, or a checkpoint could not
    be saved): one sentence, exit 1, the checkpoints kept."""


def start(launch: Launch, cfg: Config) -> None:
    """Process groups and the model-parallel layout of cfg.parallel, then SIGTERM/SIGUSR1/Ctrl-C handling
    (finish the step, save, exit), process lifetimes tied (nothing survives a kill -9 of this process or of
    torchrun) and the watchdog (a dead, failed or frozen rank stops every rank). Raises LaunchError."""
    keep_freed_memory()
    if cfg.train.threads:  # a run's numbers depend on the thread count on the CPU: recipes pin it
        torch.set_num_threads(cfg.train.threads)
    init_distributed(launch, rollout_ranks=cfg.parallel.rollout_ranks)
    p = cfg.parallel
    if launch.rank == 0:
        for line in (launch.describe() if launch.world_size > 1 else None, check_cuda_connections(p.tp, p.cp)):
            if line:
                print(line, flush=True)
    init_layout(cfg)
    if cfg.rollout.batch_invariant:  # rollouts and training alike, for the whole run
        use_batch_invariant_kernels()
    watch_preemption()
    tie_process_lifetimes()
    import torch.distributed as dist

    from . import bridge

    split = bridge.side() is not None  # the watchdog watches both sides of a disaggregated job
    watchdog.start(bridge.job_store() if split else dist.distributed_c10d._get_default_store(), launch.rank,
                   launch.world_size, cfg.train.hang_timeout_s, barrier=bridge.bridge().barrier if split else None)


def init_layout(cfg: Config) -> None:
    """megatron's model-parallel groups for cfg.parallel (on a generation rank, its generation_layout()),
    its RNG seeded with train.seed (decode CUDA graphs where rollout.cuda_graphs asks for them)."""
    from .bridge import side

    p = cfg.parallel.generation_layout() if side() is not None and side().name == "rollout" else cfg.parallel
    init_model_parallel(tp=p.tp, pp=p.pp, vpp=p.vpp if p.vpp > 1 else None, cp=p.cp, ep=p.ep, etp=p.etp or None,
                        seed=cfg.train.seed, cuda_graphs=cfg.rollout.cuda_graphs)


def finish(job, launch: Launch, run_dir: Path, fresh_dir: bool) -> int:
    """job() runs the algorithm (its final metrics); the exit code: 0, with the metrics as JSON on rank 0
    (130 after Ctrl-C: saved, stopped as a shell expects); 1 when the run stopped on purpose (RunStopped);
    2 on a UserError (its sentence alone; a run directory this run made is removed: nothing half-written).
    Any other exception is a bug: its traceback is printed, the other ranks are stopped, and the run
    directory stays."""
    import json

    try:
        final = job()
    except (RunStopped, UserError) as e:
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
            if isinstance(e, UserError) and fresh_dir:
                shutil.rmtree(run_dir, ignore_errors=True)
        shutdown()
        return 1 if isinstance(e, RunStopped) else 2
    except Exception as e:
        if watchdog.peer_failed():  # it follows another rank's failure, which that rank printed
            os._exit(1)
        if not watchdog.running():  # one process: the exception goes on to the caller (tests, the bench)
            raise
        traceback.print_exc()  # print first: this rank's watchdog, too, ends it once it hears the abort
        sys.stderr.flush()
        watchdog.abort(f"failed {launch.rank}: {type(e).__name__}")  # the others stop
        raise SystemExit(1) from None
    if launch.rank == 0:
        print(json.dumps({"run_dir": str(run_dir), **final}))
    shutdown()
    return 130 if interrupted() else 0
