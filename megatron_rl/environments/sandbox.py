"""Running untrusted programs (a model's tool calls) outside the trainer, contained.

The trainer is large, threaded and may hold CUDA contexts: it never runs or forks the program itself.
Each program starts as a fresh process tree from `subprocess`:

- as root (CI is): bubblewrap puts it in new PID, mount, network, IPC and UTS namespaces with the
  whole filesystem read-only, a private /tmp, and one writable fresh working directory
  (/tmp/work); then setpriv drops it to the unprivileged user and group nobody (65534) with no
  capabilities and no_new_privs. Root alone would contain nothing: it ignores the process limit and
  can raise its own limits.
- not root: bubblewrap in a user namespace (where the kernel allows them), the same namespaces.
- neither possible: refused, unless sandbox.allow_unisolated=true (resource limits alone).

Inside, before the program runs: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE and no core
files; where a cgroup can be made (root, a writable cgroup hierarchy), its memory and process count
are capped too. The wall clock is watched from outside: past sandbox.timeout_s the process tree is
killed (bubblewrap's --die-with-parent takes down the PID namespace, and with it every process the
program left behind). Output is read while it runs, max_output_kb kept per stream; a program that
writes four times that is stopped. The program runs on Python's standard library alone (python -I -S).
"""

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config import ConfigError

NOBODY = 65534
WORKDIR = "/tmp/work"  # inside the sandbox

# Runs as the sandbox's user, before the program: limits it cannot raise again, then the program.
PRELUDE = """
import resource, sys
cpu, memory, processes, file_size = map(int, sys.argv[1:5])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_NPROC, processes),
                     (resource.RLIMIT_FSIZE, file_size), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
del resource, cpu, memory, processes, file_size, limit, value
sys.argv = ["main.py"]
with open("main.py") as f:
    code = compile(f.read(), "main.py", "exec")
exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass
class Outcome:
    stdout: str
    stderr: str
    returncode: int | None  # None: stopped from outside (timeout, output limit)
    status: str  # ok | error (a non-zero exit) | killed (by a signal: a CPU or memory limit, a crash) | timeout | output_limit
    seconds: float
    timeout_s: float = 0.0  # the wall-clock limit it ran under

    def describe(self) -> str:
        """One line for an error observation."""
        if self.status == "timeout":
            return f"the program did not finish within {self.timeout_s:g} s and was stopped"
        if self.status == "output_limit":
            return "the program wrote too much output and was stopped"
        if self.status == "killed":
            return f"the program was killed by signal {-self.returncode} ({signal.Signals(-self.returncode).name})"
        if self.status == "error":
            last = self.stderr.strip().splitlines()[-1:] or [f"exit status {self.returncode}"]
            return last[0]
        return "ok"


def isolation() -> str:
    """How programs can be contained here: 'root' (namespaces and the nobody user), 'userns'
    (bubblewrap in a user namespace) or 'none'."""
    if not shutil.which("bwrap"):
        return "none"
    if os.geteuid() == 0:
        return "root" if shutil.which("setpriv") else "none"
    probe = subprocess.run(["bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True)
    return "userns" if probe.returncode == 0 else "none"


class Sandbox:
    def __init__(self, cfg):
        """cfg: the sandbox section (SandboxConfig)."""
        self.cfg = cfg
        self.mode = isolation()
        if self.mode == "none" and not cfg.allow_unisolated:
            why = ("bubblewrap (bwrap) is not installed" if not shutil.which("bwrap") else
                   "setpriv is not installed" if os.geteuid() == 0 else
                   "this kernel does not let an unprivileged user create namespaces")
            raise ConfigError(f"the code sandbox cannot isolate programs here ({why}): install bubblewrap (Debian: "
                              f"apt-get install bubblewrap) or run as root; sandbox.allow_unisolated=true runs them "
                              f"with resource limits alone, for code you trust.")

    def command(self, work: Path) -> list[str]:
        c = self.cfg
        # the interpreter itself (a virtual environment's python is a link to it; -S needs no site-packages)
        interpreter = os.path.realpath(sys.executable)
        python = [interpreter, "-I", "-S", "-c", PRELUDE, str(c.cpu_s), str(c.memory_mb << 20),
                  str(c.max_processes), str(c.max_file_mb << 20)]
        if self.mode == "none":
            return python
        # the sandbox's /tmp is its own: an interpreter installed under the host's /tmp is bound in, read-only
        hidden = [p for p in {os.path.realpath(sys.base_prefix), os.path.dirname(interpreter)} if p.startswith("/tmp/")]
        jail = ["bwrap", "--ro-bind", "/", "/", "--tmpfs", "/tmp", *[a for p in sorted(hidden) for a in ("--ro-bind", p, p)],
                "--bind", str(work), WORKDIR, "--proc", "/proc",
                "--dev", "/dev", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv",
                "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", WORKDIR, "--chdir", WORKDIR]
        if self.mode == "userns":
            return [*jail, "--unshare-user", "--cap-drop", "ALL", *python]
        return [*jail, "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "--", *python]

    def run(self, program: str, stdin: str = "") -> Outcome:
        """Run a Python program; its working directory starts empty and is deleted afterwards."""
        c = self.cfg
        work = Path(tempfile.mkdtemp(prefix="mrl-sandbox-"))
        groups = _cgroups(c) if self.mode == "root" else []
        try:
            (work / "main.py").write_text(program)
            if self.mode == "root":
                os.chown(work, NOBODY, NOBODY)
            cmd = self.command(work)
            if groups:  # the shell joins the cgroups, then becomes bubblewrap: every descendant is in them
                cmd = ["/bin/sh", "-c", 'for f in $MRL_CGROUPS; do echo $$ > "$f" || exit 97; done; exec "$@"', "sh", *cmd]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "MRL_CGROUPS": " ".join(str(g / "cgroup.procs") for g in groups)}
            start = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            try:
                out, err, status = _collect(proc, stdin.encode(), start + c.timeout_s, c.max_output_kb << 10)
            finally:
                _kill(proc, groups)
            seconds = time.monotonic() - start
            code = proc.returncode
            if code > 128 and self.mode != "none":  # bubblewrap exits 128 + N when the program died of signal N
                code = 128 - code
            if status == "done":
                status = "ok" if code == 0 else "killed" if code < 0 else "error"
            return Outcome(out.decode(errors="replace"), err.decode(errors="replace"),
                           code if status in ("ok", "error", "killed") else None, status, seconds, c.timeout_s)
        finally:
            for g in groups:
                _remove_cgroup(g)
            shutil.rmtree(work, ignore_errors=True)


def _collect(proc, stdin: bytes, deadline: float, keep: int):
    """Read stdout and stderr until the program ends, the deadline passes or it writes more than 4x
    `keep` bytes; keep the first `keep` of each. Returns (stdout, stderr, 'done'|'timeout'|'output_limit')."""
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    total = 0
    with selectors.DefaultSelector() as sel:
        for f in kept:
            os.set_blocking(f.fileno(), False)
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), "timeout"
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = key.fileobj.read(65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.fileobj]
                buf += chunk[: max(0, keep - len(buf))]
                total += len(chunk)
                if total > 4 * keep:
                    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), "output_limit"
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), "timeout"
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), "done"


def _kill(proc, groups: list[Path]):
    """Stop the program and everything it started: bubblewrap's process group (its PID namespace dies
    with it), then whatever is left in the cgroups."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        f.close()
    for g in groups:
        for _ in range(50):
            pids = [int(p) for p in (g / "cgroup.procs").read_text().split()] if (g / "cgroup.procs").exists() else []
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)


def _cgroups(cfg) -> list[Path]:
    """Cgroups capping the program's processes and memory where the hierarchy is writable (cgroup v2,
    or v1's pids and memory controllers); none where it is not (the rlimits still apply)."""
    name = f"mrl-sandbox-{uuid.uuid4().hex[:12]}"
    memory, pids = str(cfg.memory_mb << 20), str(cfg.max_processes)
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():  # v2
        candidates = [(root, {"pids.max": pids, "memory.max": memory})]
    else:
        candidates = [(root / "pids", {"pids.max": pids}), (root / "memory", {"memory.limit_in_bytes": memory})]
    made = []
    for base, limits in candidates:
        try:
            (base / name).mkdir()
        except OSError:
            continue
        try:
            for file, value in limits.items():
                (base / name / file).write_text(value)
            made.append(base / name)
        except OSError:
            _remove_cgroup(base / name)
    return made


def _remove_cgroup(path: Path):
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # its last process is still exiting
            time.sleep(0.01)
