"""The code tool's sandbox against adversarial programs: each is contained within its limits, gets an
error outcome, leaves canary files outside untouched and leaves no process behind; the next program
runs as usual."""

import os
import shutil
import socket
import subprocess
import time

import pytest

from megatron_rl.config import ConfigError, SandboxConfig
from megatron_rl.environments.sandbox import NOBODY, Sandbox, isolation
from tests.helpers import ROOT

pytestmark = [
    pytest.mark.skipif(isolation() != "root", reason="the sandbox's adversarial suite needs root and bubblewrap "
                                                      "(make test installs it with apt-get as root)"),
    # one worker runs them in turn: each checks that no sandboxed process of this module outlives its call,
    # which another's fork bomb, running at the same time, would break
    pytest.mark.xdist_group("sandbox"),
]

LIMITS = SandboxConfig(timeout_s=3, cpu_s=2, memory_mb=256, max_processes=16, max_file_mb=1, max_output_kb=4)


def sandbox_processes() -> list[str]:
    """Processes of the sandbox's user still alive on this machine, but for other modules' sandboxed
    programs (a GRPO run's code tool, say), which run with other limits."""
    ours = f" {LIMITS.cpu_s} {LIMITS.memory_mb << 20} {LIMITS.max_processes} {LIMITS.max_file_mb << 20} "
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(line for line in f if line.startswith("Uid:")).split()[1]
            if int(uid) != NOBODY:
                continue
            command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            theirs = " -I -S -c " in command and not command.endswith(ours)  # another module's sandboxed program
            if not theirs:
                alive.append(command)
        except (OSError, StopIteration):
            continue
    return alive


@pytest.fixture(scope="module")
def canaries(tmp_path_factory):
    """A file and a directory outside the working directory, one readable by all, one by root only."""
    root = tmp_path_factory.mktemp("canary")
    (root / "open.txt").write_text("public canary")
    (root / "secret.txt").write_text("secret canary")
    os.chmod(root / "secret.txt", 0o600)
    os.chmod(root, 0o755)
    return root


def programs(canaries, port):
    secret, public = canaries / "secret.txt", canaries / "open.txt"
    return {
        "infinite loop": ("while True:\n    pass", {"timeout", "killed"}),
        "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", {"timeout", "killed"}),
        "memory bomb": ("x = bytearray(1 << 34)", {"error", "killed"}),
        "socket to 127.0.0.1": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", {"error"}),
        "write outside": (f"open({str(public)!r}, 'w').write('owned')\n", {"error"}),
        "read outside": (f"print(open({str(secret)!r}).read())", {"error"}),
        "kill the parent": (f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)\n"
                            "os.kill(-1, signal.SIGKILL)", {"error", "killed"}),
        "enormous output": ("while True:\n    print('x' * 10000)", {"output_limit"}),
        "ctypes": ("import ctypes\nlibc = ctypes.CDLL(None)\nassert libc.setuid(0) == 0, 'setuid failed'\n"
                   "ctypes.string_at(0)", {"error", "killed"}),
        "os.system": (f"import os\nassert os.system('rm -rf {canaries} /usr/bin/true') == 0, 'rm failed'", {"error"}),
        "sleep past the timeout": ("import time\ntime.sleep(60)", {"timeout"}),
        "delete files": (f"import shutil\nshutil.rmtree({str(canaries)!r})", {"error"}),
        "background process": ("import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True)\n"
                               "subprocess.Popen('sleep 601 &', shell=True)", {"ok"}),
        "raise its limits": ("import resource\nresource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))", {"error"}),
        "become root": ("import os\nos.setuid(0)", {"error"}),
        "big file": ("open('big', 'wb').write(b'0' * (8 << 20))", {"error", "killed"}),
    }


NAMES = ["infinite loop", "fork bomb", "memory bomb", "socket to 127.0.0.1", "write outside", "read outside",
         "kill the parent", "enormous output", "ctypes", "os.system", "sleep past the timeout", "delete files",
         "background process", "raise its limits", "become root", "big file"]


@pytest.mark.parametrize("name", NAMES)
def test_adversarial_program_is_contained(name, canaries):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)
    program, expected = programs(canaries, listener.getsockname()[1])[name]
    sandbox = Sandbox(LIMITS)
    start = time.monotonic()
    outcome = sandbox.run(program)
    took = time.monotonic() - start
    assert outcome.status in expected, (name, outcome)
    assert took < LIMITS.timeout_s + 5  # stopped at the wall-clock limit (plus start-up and clean-up on a busy machine)
    assert len(outcome.stdout) <= LIMITS.max_output_kb << 10 and len(outcome.stderr) <= LIMITS.max_output_kb << 10
    assert outcome.describe()
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing reached the trainer's loopback
    listener.close()
    assert (canaries / "open.txt").read_text() == "public canary"
    assert (canaries / "secret.txt").read_text() == "secret canary"
    assert shutil.which("true")
    assert sandbox_processes() == []  # no process of it survives the call
    after = sandbox.run("print(sum(range(10)))")  # the next call works as usual
    assert (after.status, after.stdout) == ("ok", "45\n")


def test_the_program_sees_a_fresh_writable_directory_and_stdin():
    sandbox = Sandbox(LIMITS)
    outcome = sandbox.run("import os, sys\nopen('f', 'w').write('x')\nprint(os.getuid(), os.getcwd(), sorted(os.listdir('.')),"
                          " sys.stdin.read(), os.listdir('/tmp'))", stdin="hello")
    assert outcome.status == "ok", outcome
    assert outcome.stdout.split(" ", 2)[:2] == [str(NOBODY), "/tmp/work"]
    assert "['f', 'main.py'] hello ['work']" in outcome.stdout
    assert sandbox.run("import os; print(os.listdir('.'))").stdout == "['main.py']\n"  # fresh each call


def test_without_isolation_the_sandbox_refuses_unless_allowed(tmp_path):
    """Not root and no bubblewrap: refused in one sentence; sandbox.allow_unisolated=true runs with the
    limits alone."""
    script = ("import os; os.environ['PATH'] = '/nonexistent'\n"
              "from megatron_rl.config import ConfigError, SandboxConfig\n"
              "from megatron_rl.environments.sandbox import Sandbox\n"
              "try:\n    Sandbox(SandboxConfig())\nexcept ConfigError as e:\n    print('refused:', e)\n"
              "print(Sandbox(SandboxConfig(allow_unisolated=True, timeout_s=1)).run('print(7)').stdout)")
    python = shutil.which("python3", path="/usr/bin:/bin")  # one the user nobody may run (a venv may be under /root)
    if python is None:
        pytest.skip("no system python3 for the user nobody")
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, "-c", script],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: the code sandbox cannot isolate programs here (bubblewrap (bwrap) is not installed)" in proc.stdout
    assert proc.stdout.strip().endswith("7")
    with pytest.raises(ConfigError, match="sandbox.timeout_s=0"):
        SandboxConfig(timeout_s=0).validate()
