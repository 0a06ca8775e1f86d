"""nvtx ranges and an nsys capture window; no-ops on CPU or when profiling is off."""

import contextlib

import torch


class Profiler:
    def __init__(self, nvtx: bool = False, nsys_start: int = -1, nsys_end: int = -1):
        self.nvtx = nvtx and torch.cuda.is_available()
        self.start, self.end = nsys_start, nsys_end
        self.capturing = False

    @contextlib.contextmanager
    def range(self, name: str):
        """An nvtx range around one phase (rollout, logprob, train, ...)."""
        if not self.nvtx:
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()

    def step(self, step: int):
        """Call at the start of each step: opens/closes the cudaProfilerApi capture window."""
        if not torch.cuda.is_available() or self.start < 0:
            return
        if step == self.start and not self.capturing:
            torch.cuda.profiler.start()
            self.capturing = True
        elif step == self.end and self.capturing:
            torch.cuda.profiler.stop()
            self.capturing = False
