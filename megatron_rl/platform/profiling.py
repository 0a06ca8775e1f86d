"""Where a run's time goes: phase timing for the end-of-run table (every run), nvtx ranges and the
nsys capture window (CUDA), and a torch.profiler trace of the same window (any device).

The window is steps [profiling.nsys_start, profiling.nsys_end) on the ranks in profiling.ranks.
"""

import contextlib
import time
from collections import defaultdict
from pathlib import Path

import torch

from megatron_rl.platform import watchdog


class Profiler:
    def __init__(self, cfg=None, rank: int = 0, run_dir: str | Path = "."):
        """cfg: the ProfilingConfig (None: timing only)."""
        from megatron_rl.config import ProfilingConfig

        cfg = cfg or ProfilingConfig()
        cuda, mine = torch.cuda.is_available(), rank in cfg.ranks
        self.start, self.end = cfg.window()
        self.nvtx = cfg.nvtx and cuda and mine
        self.nsys = cuda and mine and cfg.nsys_start >= 0
        self.trace_dir = Path(run_dir) / "profile" if cfg.torch_profiler and mine else None
        self.rank = rank
        self.torch_profiler = None
        self.capturing = False
        self.seconds: dict[str, float] = defaultdict(float)  # per phase, over the run
        self.last: dict[str, float] = defaultdict(float)  # per phase, in the step now running
        self.steps = 0

    @contextlib.contextmanager
    def range(self, name: str):
        """One phase (rollout, logprob, train, eval ...): timed, an nvtx range, and a named range in
        the torch.profiler trace while it records."""
        t0 = time.perf_counter()
        watchdog.beat(name)
        with contextlib.ExitStack() as stack:
            if self.nvtx:
                torch.cuda.nvtx.range_push(name)
                stack.callback(torch.cuda.nvtx.range_pop)
            if self.torch_profiler is not None:
                stack.enter_context(torch.profiler.record_function(name))
            try:
                yield
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.last[name] += time.perf_counter() - t0

    def step(self, step: int):
        """Call at the start of each step: opens and closes the capture window."""
        watchdog.steps_started()
        watchdog.beat(f"step {step}")
        self.steps += 1
        self.last = defaultdict(float)
        if step == self.start and not self.capturing:
            self.capturing = True
            if self.nsys:
                torch.cuda.profiler.start()
            if self.nvtx:  # the autograd ops as nvtx ranges too, inside the window only
                self._emit_nvtx = torch.autograd.profiler.emit_nvtx()
                self._emit_nvtx.__enter__()
            if self.trace_dir is not None:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.torch_profiler = torch.profiler.profile(
                    activities=activities, on_trace_ready=torch.profiler.tensorboard_trace_handler(
                        str(self.trace_dir), worker_name=f"rank{self.rank}"))
                self.torch_profiler.start()
        elif step == self.end and self.capturing:
            self.stop()

    def stop(self):
        """Close the window if it is open (also at the end of a run that stops inside it)."""
        if not self.capturing:
            return
        self.capturing = False
        if self.nvtx:
            self._emit_nvtx.__exit__(None, None, None)
        if self.nsys:
            torch.cuda.profiler.stop()
        if self.torch_profiler is not None:
            self.torch_profiler.stop()  # writes <run_dir>/profile/rank<r>.<time>.pt.trace.json
            self.torch_profiler = None

    def table(self) -> str:
        """Time per phase over the run so far, one line each."""
        total = sum(self.seconds.values())
        lines = [f"{'phase':<10} {'seconds':>9} {'share':>6} {'per step':>9}"]
        for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            lines.append(f"{name:<10} {s:>9.1f} {s / max(total, 1e-9):>6.0%} {s / max(self.steps, 1):>9.2f}")
        return "\n".join(lines)
