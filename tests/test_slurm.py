"""slurm/ against a real Slurm: a one-node cluster on this machine (Debian's slurm-wlm and munge;
munged, slurmctld and slurmd on localhost with 2 CPUs), `make test` installs them where it can.

The single-node sbatch script, adapted to the CPU on the command line (2 tasks, no GPUs), trains
tiny_sft at TP2; `srun -n 1 torchrun --nproc-per-node 2` (torchrun inside an srun step, whose
RANK/WORLD_SIZE must win over SLURM_*) trains the same: the losses must be equal. Debian 12's Slurm
(22.05) has no `--segment` (24.11+): nothing here covers it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, free_port, threads, torchrun

pytestmark = pytest.mark.xdist_group("slurm")

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun")

SLURM_CONF = """ClusterName=megatronrl
SlurmctldHost={host}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName={host} CPUs=2 State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _why_not() -> str | None:
    missing = [d for d in DAEMONS if not shutil.which(d) and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; `make test` installs slurm-wlm and munge as root)"
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root"
    if not os.path.exists("/etc/munge/munge.key"):
        return "munge has no key (/etc/munge/munge.key)"
    return None


def _pid(path) -> int | None:
    try:
        return int(open(path).read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """SLURM_CONF of a running one-node cluster; the daemons are stopped by pid afterwards."""
    why = _why_not()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    shutil.copy("/etc/munge/munge.key", d / "munge.key")
    os.chmod(d / "munge.key", 0o600)
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, d=d, ctld_port=free_port(), d_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    sbin = lambda name: shutil.which(name) or f"/usr/sbin/{name}"  # noqa: E731
    subprocess.run([sbin("munged"), f"--key-file={d}/munge.key", f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed", "--force"], check=True, timeout=30)
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([sbin(daemon), "-f", str(conf)], env=env, check=True, timeout=30)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
            if out.stdout.strip() == "idle":
                break
            time.sleep(1)
        else:
            pytest.skip(f"the local Slurm cluster did not come up (sinfo: {out.stdout.strip() or out.stderr.strip()})")
        yield env
    finally:
        for name in ("slurmd", "slurmctld", "munged"):
            pid = _pid(d / f"{name}.pid")
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def test_single_node_script_trains_as_torchrun_does(cluster, tmp_path):
    args = ["tiny_sft", "parallel.tp=2", "train.max_steps=2", "train.eval_every=0", "checkpoint.save=false",
            "logging.progress=false", "logging.tensorboard=false"]
    env = {**cluster, "PYTHON": sys.executable, "OMP_NUM_THREADS": threads(2), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(["sbatch", "--wait", "--ntasks-per-node=2", "--gpus-per-node=0", "--time=10",
                          f"--output={tmp_path}/slurm-%j.out", "slurm/single_node.sbatch", *args,
                          f"logging.run_dir={tmp_path / 'sbatch'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert out.returncode == 0, out.stderr[-2000:] + log[-3000:]
    assert f"launch: slurm, 2 rank(s) on 1 node(s) ({socket.gethostname()})" in log
    launcher = [*torchrun(2), "train.py", "--recipe", *args, f"logging.run_dir={tmp_path / 'torchrun'}"]
    out = subprocess.run(["srun", "-n", "1", "--cpus-per-task=2", "--time=10", *launcher], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "launch: torchrun, 2 rank(s)" in out.stdout
    sbatch_losses = _losses(tmp_path / "sbatch")
    assert len(sbatch_losses) == 2 and sbatch_losses == _losses(tmp_path / "torchrun")
