"""The sandbox section: where a tool's untrusted programs run (megatron_rl/environments/sandbox.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import positive


@dataclass(kw_only=True)
class SandboxConfig:
    timeout_s: float = 10.0
    """Wall-clock limit of one program; past it every process of the program is killed."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS), and the memory of all its processes where a cgroup can be made."""
    max_processes: int = 32
    """Processes and threads of the sandbox user (RLIMIT_NPROC; also the cgroup's pids.max where writable)."""
    max_file_mb: int = 16
    """Largest file a program may write (RLIMIT_FSIZE)."""
    max_output_kb: int = 16
    """Output kept of stdout and of stderr each; a program writing 4x as much is stopped."""
    allow_unisolated: bool = False
    """Where no isolation is possible (not root, and no user namespaces for bubblewrap), run programs
    with the resource limits alone rather than refuse: only for code you trust."""

    def validate(self):
        positive(self, "timeout_s", "cpu_s", "memory_mb", "max_processes", "max_file_mb", "max_output_kb")
