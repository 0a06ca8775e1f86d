"""Faults a long run meets, each survived: a kill after the last checkpoint (the logs are cut back to
it on resume), preemption signals (save, exit 0, resume=auto), a run directory of another run,
non-finite losses or gradients (the step is skipped; too many in a row stop the run in one
sentence). (Reward functions that fail or return no number: tests/test_grpo.py; a taken port:
tests/test_platform.py.)"""

import pytest
import torch

from megatron_rl.checkpointing import checkpoint_dir
from tests.helpers import column, metrics, run_train

pytestmark = pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")

FAST = ["data.num_train=2000", "data.micro_batch_size=32", "data.num_val=128", "train.eval_every=0",
        "scheduler.decay_steps=100", "logging.progress=false", "logging.tensorboard=false"]


def test_resume_cuts_the_logs_back_to_the_checkpoint(tmp_path):
    """A run killed while writing its last checkpoint logged steps after the one it resumes from:
    metrics.jsonl and TensorBoard are cut back to that checkpoint, so each step appears once, with
    the values of an uninterrupted run (bitwise)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rl.checkpointing import MARKER

    run = ["--recipe", "tiny_sft", *FAST, "train.max_steps=6", "checkpoint.save_every=3", "logging.tensorboard=true",
           f"logging.run_dir={tmp_path}"]
    run_train(run)
    straight = column(tmp_path, "train/loss")
    (checkpoint_dir(tmp_path, 6) / MARKER).unlink()  # killed before the marker of step 6 was written
    run_train([*run, "checkpoint.resume=true"])
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert column(tmp_path, "train/loss") == straight
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(straight, rel=1e-6)  # stored as fp32


def test_non_finite_gradient_applies_no_update(one_process):
    """A NaN in one gradient: no parameter changes, the LR schedule stays, the step is counted; the
    next finite step updates again and resets the count in a row."""
    from megatron_rl.config import apply_overrides
    from megatron_rl.training.setup import build_trainee
    from megatron_rl.training.step import optimizer_step, zero_grads
    from recipes import get_recipe

    cfg = apply_overrides(get_recipe("tiny_sft"), ["model.vocab_size=16", "scheduler.warmup_steps=0"])
    trainee = build_trainee(cfg)
    params = [p for chunk in trainee.model for p in chunk.parameters()]

    def step(bad: bool):
        zero_grads(trainee)
        for p in params:
            p.main_grad.fill_(0.01)
        if bad:
            params[3].main_grad[0] = float("nan")
        before = [p.detach().clone() for p in params]
        applied, norm = optimizer_step(trainee)
        return applied, norm, any(not torch.equal(a, p) for a, p in zip(before, params))

    assert step(False)[::2] == (True, True)
    scheduled = trainee.scheduler.num_steps
    applied, norm, changed = step(True)
    assert (applied, changed, trainee.scheduler.num_steps, trainee.skipped_steps) == (False, False, scheduled, 1)
    assert norm != norm  # NaN
    assert step(False)[::2] == (True, True) and trainee.skipped_in_a_row == 0 and trainee.skipped_steps == 1


def test_diverging_run_skips_then_stops_in_one_sentence(tmp_path):
    """An absurd learning rate makes the loss NaN: those steps apply nothing (the LR schedule does not
    move), are counted, and after train.max_skipped_steps in a row the run stops: exit 1, one sentence,
    the run directory and its checkpoints left as they were."""
    proc = run_train(["--recipe", "tiny_sft", *FAST, "optimizer.lr=1e30", "train.max_skipped_steps=3",
                      "train.max_steps=20", "checkpoint.save_every=1", f"logging.run_dir={tmp_path}"], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: 3 optimizer steps in a row had a non-finite loss or gradient norm (train.max_skipped_steps=3), so the "
        "run stops; its last checkpoint is intact: resume with a lower optimizer.lr or check the data."]
    rows = metrics(tmp_path)
    skipped = [r for r in rows if r["train/skipped_steps"] > 0]
    assert [r["train/skipped_steps"] for r in skipped] == [1, 2]
    assert all(r["train/lr"] == skipped[0]["train/lr"] for r in skipped)
    assert (checkpoint_dir(tmp_path, rows[-1]["step"]) / "complete").exists()


def _wait_for_steps(run_dir, n: int, proc, timeout: float = 120, or_end: bool = False):
    """Until run_dir's metrics.jsonl has n rows (or_end: or the run ended)."""
    import time

    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.02)
    if not or_end:
        raise AssertionError(f"{run_dir} did not log {n} steps")


def _start(args: list[str], nproc: int = 1, quiet: bool = False, script: str = "train.py"):
    import subprocess
    import sys

    from tests.helpers import ROOT, launch_env, torchrun

    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen([*launcher, script, *args], cwd=ROOT, env=launch_env(nproc), stdout=out, stderr=out,
                            text=True, start_new_session=True)


def _processes_of(run_dir) -> list[int]:
    """Live processes (not zombies) started for the run writing to run_dir, forked children included."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if f"logging.run_dir={run_dir}".encode() in (proc / "cmdline").read_bytes() and \
                    ") Z " not in (proc / "stat").read_text():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _saving(run_dir) -> bool:
    """Whether a checkpoint is being written (files in a .partial directory) at this moment."""
    try:
        return any((run_dir / "checkpoints").glob(".step_*.partial/*"))
    except FileNotFoundError:  # published (renamed into place) while being listed
        return False


def _kill_and_resume(run: list[str], run_dir, seed: int, kills: int = 5, nproc: int = 1) -> int:
    """Start `run` in run_dir, SIGKILL it at a random moment, resume; `kills` times, the second kill
    while a checkpoint is being written; then run to the end. One process: only the main process is
    killed, and nothing it forked may outlive it; several: only torchrun, and no rank may outlive it. After each
    kill every published checkpoint is intact. Returns how many kills hit a save."""
    import os
    import random
    import signal
    import time

    from megatron_rl.checkpointing import damage, latest_checkpoint

    rng, in_save = random.Random(seed), 0
    for kill in range(kills):
        resume = "true" if latest_checkpoint(run_dir) else "auto"
        proc = _start([*run, f"checkpoint.resume={resume}", f"logging.run_dir={run_dir}"], nproc, quiet=True)
        logged = len(metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
        t0 = time.time()
        while proc.poll() is None and time.time() - t0 < 120:
            rows = len((run_dir / "metrics.jsonl").read_text().splitlines()) if (run_dir / "metrics.jsonl").exists() else 0
            saving = _saving(run_dir)
            if (kill == 1 and saving) or (kill != 1 and rows > logged + rng.randrange(3)):
                break
            time.sleep(0.002)
        assert proc.poll() is None, f"the run ended before kill {kill}"
        if kill != 1:
            time.sleep(rng.uniform(0, 0.3))
        in_save += _saving(run_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 5
        while _processes_of(run_dir) and time.time() < deadline:
            time.sleep(0.05)
        assert not _processes_of(run_dir), f"processes of the killed run survive it (kill {kill})"
        for path in (run_dir / "checkpoints").glob("step_*"):
            assert damage(path) is None and (path / "complete").exists(), path
    run_train([*run, "checkpoint.resume=true", f"logging.run_dir={run_dir}"], nproc=nproc)
    return in_save


def _without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


@pytest.mark.parametrize("recipe, nproc", [
    (["--recipe", "tiny_sft", *FAST, "train.max_steps=14"], 1),
    # DAPO: GRPO with dynamic sampling (a varying number of prompt batches per step), from random weights
    # (the overlong penalty gives groups unequal rewards, so steps update the model)
    (["--recipe", "tiny_dapo", "checkpoint.load=", "train.max_steps=10", "algorithm.prompts_per_step=8", "data.num_train=2000",
      "rollout.n=4", "data.micro_batch_size=16", "train.eval_every=0", "data.num_val=16", "logging.progress=false", "logging.tensorboard=false"], 1),
    (["--recipe", "tiny_dapo", "checkpoint.load=", "train.max_steps=10", "algorithm.prompts_per_step=8", "data.num_train=2000",
      "rollout.n=4", "data.micro_batch_size=16", "train.eval_every=0", "data.num_val=16", "logging.progress=false", "logging.tensorboard=false",
      "parallel.dp=2"], 2),
    # disaggregated, synchronous (algorithm.max_staleness=0): rank 1 generates, rank 0 trains
    (["--recipe", "tiny_dapo", "checkpoint.load=", "train.max_steps=10", "algorithm.prompts_per_step=8", "data.num_train=2000",
      "rollout.n=4", "data.micro_batch_size=16", "train.eval_every=0", "data.num_val=16", "logging.progress=false", "logging.tensorboard=false",
      "parallel.rollout_ranks=1"], 2)], ids=["sft", "dapo", "dapo-dp2", "dapo-split"])
def test_kill_9_anywhere_then_resume_is_bitwise(recipe, nproc, tmp_path):
    """kill -9 at five random moments (one inside a checkpoint save), each followed by a resume: every
    step after it equals the uninterrupted run bitwise (all metrics but timings), each step logged once."""
    run = [*recipe, "checkpoint.save_every=2", "checkpoint.keep=2"]
    run_train([*run, f"logging.run_dir={tmp_path / 'straight'}"], nproc=nproc)
    assert _kill_and_resume(run, tmp_path / "killed", seed=len(recipe) + nproc, nproc=nproc) >= 1
    assert _without_timings(metrics(tmp_path / "killed")) == _without_timings(metrics(tmp_path / "straight"))


def _rank_pid(run_dir, rank: int) -> int:
    """The process of one torchrun worker of the run writing to run_dir."""
    from pathlib import Path

    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"logging.run_dir={run_dir}" in cmdline and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no rank {rank} process of {run_dir}")


def test_preemption_saves_and_resumes(tmp_path):
    """SIGTERM to a one-process run, and SIGUSR1 to one rank of two: every rank finishes its step,
    saves, exits 0. checkpoint.resume=auto then continues to the end, each step once and (one
    process) bitwise as the uninterrupted run; in a fresh directory auto starts from scratch."""
    import os
    import signal

    from megatron_rl.checkpointing import latest_checkpoint

    run = ["--recipe", "tiny_sft", *FAST, "train.max_steps=40", "checkpoint.resume=auto"]
    straight, preempted, pair = tmp_path / "straight", tmp_path / "preempted", tmp_path / "pair"
    proc = _start([*run, f"logging.run_dir={preempted}"])
    _wait_for_steps(preempted, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped = metrics(preempted)[-1]["step"]
    assert stopped < 40 and latest_checkpoint(preempted).name == f"step_{stopped:07d}"
    assert f"preempted: stopped after step {stopped}, saved a checkpoint" in out
    run_train([*run, f"logging.run_dir={preempted}"])
    run_train([*run, f"logging.run_dir={straight}"])  # auto in a fresh directory: from scratch
    assert [r["step"] for r in metrics(preempted)] == list(range(1, 41))
    assert column(preempted, "train/loss") == column(straight, "train/loss")

    proc = _start([*run, "parallel.dp=2", f"logging.run_dir={pair}"], nproc=2)
    _wait_for_steps(pair, 2, proc)
    os.kill(_rank_pid(pair, 1), signal.SIGUSR1)  # rank 1 only: both stop at the same step
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped = metrics(pair)[-1]["step"]
    assert stopped < 40 and latest_checkpoint(pair).name == f"step_{stopped:07d}"


def test_ctrl_c_saves_and_exits_130(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group): the run says so, finishes its
    step, saves and exits 130, no traceback; under torchrun, which forwards the signal to ranks that got it
    already, every rank stops at the same step and saves. A second Ctrl-C (a second later) stops at once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from megatron_rl.checkpointing import latest_checkpoint
    from tests.helpers import ROOT, launch_env

    run = ["--recipe", "tiny_sft", *FAST, "train.max_steps=2000"]
    for nproc in (1, 2):
        run_dir = tmp_path / f"ranks{nproc}"
        proc = _start([*run, f"parallel.dp={nproc}", f"logging.run_dir={run_dir}"], nproc=nproc)
        _wait_for_steps(run_dir, 2, proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        stopped = metrics(run_dir)[-1]["step"]
        assert stopped < 2000 and latest_checkpoint(run_dir).name == f"step_{stopped:07d}", err[-3000:]
        assert err.count("interrupted: stopping after this step and saving a checkpoint") == 1, err[-3000:]
        assert f"interrupted: stopped after step {stopped}, saved a checkpoint" in out + err
        if nproc == 1:
            assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    waiting = subprocess.Popen([sys.executable, "-c", "from megatron_rl import platform; import time; "
                                "platform.watch_preemption(); print('ready', flush=True); time.sleep(60)"],
                               cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert waiting.stdout.readline() == "ready\n"
    waiting.send_signal(signal.SIGINT)
    time.sleep(1.5)
    assert waiting.poll() is None  # the first asks for a stop after the step
    waiting.send_signal(signal.SIGINT)
    assert waiting.wait(timeout=10) == 130 and "interrupted again: stopping now" in waiting.stderr.read()


def test_run_directory_of_another_run_is_refused(tmp_path):
    """A run directory holding another recipe or another architecture is refused in one sentence
    (exit 2, the directory untouched); a changed learning rate resumes; checkpoint.resume=true with
    nothing to resume from is refused and leaves no directory."""
    run = ["train.max_steps=1", "train.eval_every=0", "logging.progress=false", "logging.tensorboard=false"]
    run_train(["--recipe", "tiny_sft", *run, f"logging.run_dir={tmp_path / 'run'}"])
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    for other, said in ((["--recipe", "tiny_dpo"], "recipe='tiny_sft' (yours: 'tiny_dpo'), algorithm.name='sft' "
                                                   "(yours: 'dpo')"),
                        (["--recipe", "tiny_sft", "model.num_layers=3"], "model.num_layers=2 (yours: 3)")):
        proc = run_train([*other, *run, f"logging.run_dir={tmp_path / 'run'}"], check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"error: {tmp_path / 'run'} holds another run: {said}; choose another logging.run_dir, or delete that "
            "directory to start over."]
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before
    run_train(["--recipe", "tiny_sft", *run, "train.max_steps=2", "optimizer.lr=1e-3", "checkpoint.resume=true",
               f"logging.run_dir={tmp_path / 'run'}"])
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
    proc = run_train(["--recipe", "tiny_sft", *run, "checkpoint.resume=true", f"logging.run_dir={tmp_path / 'new'}"],
                     check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: checkpoint.resume=true but {tmp_path / 'new'} has no complete checkpoint to resume from; use "
        "checkpoint.resume=auto to start fresh when there is none."]
    assert not (tmp_path / "new").exists()


def test_damaged_checkpoint_is_named_and_passed_over(tmp_path):
    """The completion marker records every file's size (and SHA-256 with checkpoint.verify=full): a
    truncated shard is named in one sentence by checkpoint.load (exit 2, nothing written), and
    checkpoint.resume passes over it with a warning to the newest intact checkpoint, from which the
    run continues bitwise. A same-size corruption is caught by verify=full."""
    import json

    from megatron_rl.checkpointing import LATEST, MARKER

    run = ["--recipe", "tiny_sft", *FAST, "train.max_steps=6", "checkpoint.save_every=2", "checkpoint.keep=3",
           "checkpoint.verify=full"]
    straight, damaged = tmp_path / "straight", tmp_path / "damaged"
    run_train([*run, f"logging.run_dir={straight}"])
    assert (straight / "checkpoints" / LATEST).read_text().strip() == "step_0000006"
    marker = json.loads((checkpoint_dir(straight, 6) / MARKER).read_text())
    assert marker["step"] == 6 and marker["files"] and set(marker["sha256"]) == set(marker["files"])
    import shutil

    shutil.copytree(straight, damaged)
    shard = max(checkpoint_dir(damaged, 6).glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated

    proc = run_train(["--recipe", "tiny_sft", *FAST, f"checkpoint.load={checkpoint_dir(damaged, 6)}",
                      f"logging.run_dir={tmp_path / 'new'}"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not (tmp_path / "new").exists()
    assert proc.stderr.strip().splitlines() == [
        f"error: checkpoint '{checkpoint_dir(damaged, 6)}' is damaged: {shard.name} is 100 bytes, its marker recorded "
        f"{marker['files'][shard.name]} (truncated or overwritten); load an earlier checkpoint (checkpoint.resume "
        "passes over damaged ones)."]

    proc = run_train([*run, "checkpoint.resume=true", f"logging.run_dir={damaged}"])
    assert f"warning: passing over checkpoint {checkpoint_dir(damaged, 6)}: {shard.name} is 100 bytes" in proc.stderr
    assert metrics(damaged) == metrics(straight)[:4] + metrics(damaged)[4:]
    assert column(damaged, "train/loss") == column(straight, "train/loss")  # steps 5 and 6 again, bitwise

    data = bytearray(shard.read_bytes())  # the re-saved step 6: flip a byte, keep the size
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run_train([*run, "checkpoint.resume=true", f"logging.run_dir={damaged}"])
    assert f"{shard.name} does not match its recorded SHA-256 (corrupted)" in proc.stderr
    assert column(damaged, "train/loss") == column(straight, "train/loss")


def test_full_disk_stops_the_run_in_one_sentence(tmp_path):
    """A run directory on a tmpfs with room for one checkpoint more than the run needs, but not two:
    the second save warns that space is short, fails, and the run stops in one sentence (exit 1) with
    the first checkpoint intact and no partial directory left. (Needs root for the mount.)"""
    import subprocess

    from megatron_rl.checkpointing import damage, latest_checkpoint

    run = ["--recipe", "tiny_sft", *FAST, "checkpoint.save_every=2", "checkpoint.keep=0"]
    run_train([*run, "train.max_steps=2", f"logging.run_dir={tmp_path / 'sized'}"])

    def used(path):  # bytes on a tmpfs: whole pages
        return sum(-(-f.stat().st_size // 4096) * 4096 for f in path.rglob("*") if f.is_file())

    room = used(tmp_path / "sized") + used(checkpoint_dir(tmp_path / "sized", 2)) // 2
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        proc = run_train([*run, "train.max_steps=4", f"logging.run_dir={small / 'run'}"], check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith(("warning:", "error:"))]
        assert lines[0].startswith("warning: ") and "less than the last checkpoint's" in lines[0]
        assert lines[1].startswith(f"error: no space left on the device of {small / 'run' / 'checkpoints'} to save "
                                   "step_0000004") and lines[1].endswith("then resume with checkpoint.resume=auto.")
        assert latest_checkpoint(small / "run") == checkpoint_dir(small / "run", 2)
        assert damage(checkpoint_dir(small / "run", 2), "size") is None
        assert sorted(p.name for p in (small / "run" / "checkpoints").iterdir()) == ["latest", "step_0000002"]
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_writer_out_of_space_leaves_the_last_checkpoint(one_process, tmp_path, monkeypatch):
    """ENOSPC from dist_checkpointing's writer, halfway through the shards: SaveFailed on every rank,
    the partial directory removed, the previous checkpoint and the latest pointer untouched."""
    import errno
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from megatron_rl import checkpointing
    from megatron_rl.config import apply_overrides
    from megatron_rl.training.setup import build_trainee
    from recipes import get_recipe

    trainee = build_trainee(apply_overrides(get_recipe("tiny_sft"), ["model.vocab_size=16"]))
    first = checkpointing.save(trainee, tmp_path, 1, {})
    real_save = dist_checkpointing.save

    def full_disk(state, path, *args, **kwargs):
        (Path(path) / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dist_checkpointing, "save", full_disk)
    with pytest.raises(checkpointing.SaveFailed, match="no space left on the device of .* to save step_0000002"):
        checkpointing.save(trainee, tmp_path, 2, {})
    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000001"]
    assert checkpointing.latest_checkpoint(tmp_path) == first and checkpointing.damage(first) is None


def test_rotation_killed_while_deleting_leaves_no_step_directory(tmp_path, monkeypatch):
    """checkpoint.keep's removal killed halfway through deleting an old checkpoint's files (the CI
    failure of kill -9 at step 6, keep=2): no step_* directory is left without its marker, and the
    next prune sweeps the remains."""
    import shutil
    from pathlib import Path

    from megatron_rl import checkpointing

    for step in (2, 4, 6):
        path = checkpoint_dir(tmp_path, step)
        (path / "shard").mkdir(parents=True)
        (path / "shard" / "a.distcp").write_bytes(b"x" * 10)
        (path / checkpointing.MARKER).write_text('{"step": %d, "files": {"shard/a.distcp": 10}}' % step)
    real_rmtree = shutil.rmtree

    def killed_halfway(path, ignore_errors=False):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        if files:
            files[0].unlink()
            raise KeyboardInterrupt("killed")
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpointing._prune(tmp_path, keep=2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    for path in (tmp_path / "checkpoints").glob("step_*"):
        assert (path / checkpointing.MARKER).exists() and checkpointing.damage(path) is None, path
    checkpointing._prune(tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000004", "step_0000006"]


@pytest.mark.parametrize("fault", ["raise", "slow_raise", "kill", "sleep"])
def test_a_failed_dead_or_frozen_rank_stops_every_rank(fault, tmp_path):
    """Two ranks under torchrun; at step 3 rank 1 raises, is SIGKILLed, or sleeps forever (as in a
    deadlock; before that, at step 2, it waits 15 s in a patient phase, longer than
    train.hang_timeout_s, as a long save would: the run goes on). Every process of the job ends
    within 60 s of the fault (a frozen rank: of train.hang_timeout_s passing), the error is printed
    once, by the rank that had it, and a frozen rank is named and its stacks printed. The error is
    printed even when rendering it takes longer than the watchdog's interval (slow_raise): the rank
    prints before it tells the others to stop, which its own watchdog hears too."""
    import os
    import signal
    import time

    run = ["--recipe", "tiny_sft", *FAST, "train.max_steps=200", "parallel.dp=2", "train.hang_timeout_s=10",
           "checkpoint.save=false", f"logging.run_dir={tmp_path}"]
    if fault == "kill":
        proc = _start(run, nproc=2)
        _wait_for_steps(tmp_path, 2, proc)
        os.kill(_rank_pid(tmp_path, 1), signal.SIGKILL)
    else:
        faults = "patient@2,sleep@3" if fault == "sleep" else f"{fault}@3"
        proc = _start(["1", faults, *run], nproc=2, script="tests/scripts/faulty_train.py")
        _wait_for_steps(tmp_path, 2, proc, or_end=True)
    t0 = time.time()
    out, err = proc.communicate(timeout=150)
    took = time.time() - t0 - (10 if fault == "sleep" else 0)
    assert proc.returncode != 0 and took < 60, (proc.returncode, took, err[-3000:])
    assert not _processes_of(tmp_path)
    assert len(metrics(tmp_path)) < 4
    if fault in ("raise", "slow_raise"):
        error = "RuntimeError" if fault == "raise" else "SlowToPrint"
        assert err.count(f"{error}: injected failure on rank 1 at step 3") == 1, err[-3000:]
        assert "[rank0]:" not in err  # rank 0's own error (its peer vanished) follows from it: not printed
    if fault == "sleep":
        assert "error: no rank made progress for " in err and "rank 1 stopped first, in phase 'forward'" in err
        assert "faulty_train.py\", line" in err  # the frozen rank's stacks



def test_a_bug_is_reported_with_its_traceback_and_keeps_the_run(tmp_path):
    """Only a UserError is a user's mistake (one sentence, exit 2, a fresh run directory removed): a
    ValueError from deep inside the step (a bug) prints its traceback, exits 1 and keeps the run directory
    with the steps it logged. The old train.py took every ValueError for a user error."""
    run_dir = tmp_path / "run"
    proc = _start(["0", "value_error@3", "--recipe", "tiny_sft", *FAST, "train.max_steps=20", "checkpoint.save=false",
                   f"logging.run_dir={run_dir}"], script="tests/scripts/faulty_train.py")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    assert "Traceback (most recent call last)" in err and "ValueError: injected bug on rank 0 at step 3" in err
    assert "error: injected bug" not in err
    assert run_dir.exists() and len(metrics(run_dir)) == 2

GRPO_QUICK = ["checkpoint.load=", "data.num_train=2000", "algorithm.prompts_per_step=8", "rollout.n=4", "data.micro_batch_size=16",
              "rewards.overlong_buffer=2", "train.eval_every=0", "data.num_val=16", "scheduler.decay_steps=100",
              "logging.progress=false", "logging.tensorboard=false"]
# (from random weights: the overlong penalty gives groups unequal rewards, so steps update the model)


def test_every_grpo_family_switch_resumes_bitwise(tmp_path):
    """A stop after step 2 and checkpoint.resume=true give every later step of the uninterrupted run,
    bitwise (all metrics but timings), for each GRPO-family recipe: GSPO, Dr. GRPO, CISPO, GDPO,
    importance-sampling correction, a KL penalty against the reference (which starts from a checkpoint:
    the reference is its weights), MoE router replay, REINFORCE++ (its KL in the reward), on-policy distillation (from a teacher), and PPO (its critic
    saved beside the policy and resumed with it)."""
    init = tmp_path / "init"
    variants = {"gspo": ["--recipe", "tiny_gspo"], "drgrpo": ["--recipe", "tiny_drgrpo"],
                "cispo": ["--recipe", "tiny_cispo"], "gdpo": ["--recipe", "tiny_gdpo"],
                "is": ["--recipe", "tiny_grpo_is"], "moe": ["--recipe", "tiny_moe_grpo"],
                "kl": ["--recipe", "tiny_grpo", "algorithm.kl_coef=0.05", f"checkpoint.load={init}"],
                "reinforce_pp": ["--recipe", "tiny_reinforce_pp", f"checkpoint.load={init}"],
                "distill": ["--recipe", "tiny_distill", f"checkpoint.load={init}", f"distill.teacher={init}"],
                "ppo": ["--recipe", "tiny_ppo", f"checkpoint.load={init}", "algorithm.kl_coef=0.05",
                        "ppo.critic_warmup_steps=1"]}
    runs = [["--recipe", "tiny_sft", *FAST, "train.max_steps=1", f"logging.run_dir={init}"]]
    for name, recipe in variants.items():
        run = [*recipe[:2], *GRPO_QUICK, *recipe[2:], "train.max_steps=4", "checkpoint.save_every=2"]
        runs += [[*run, f"logging.run_dir={tmp_path / name / 'straight'}"],
                 [*run, "train.max_steps=2", f"logging.run_dir={tmp_path / name / 'split'}"],
                 [*run, "checkpoint.resume=true", f"logging.run_dir={tmp_path / name / 'split'}"]]
    from tests.helpers import run_recipes

    run_recipes(runs)
    for name in variants:  # (the split run also evaluated at its stop, step 2)
        straight, split = ([{k: v for k, v in row.items() if k.startswith(("step", "train/", "rollout/"))}
                            for row in metrics(tmp_path / name / r)] for r in ("straight", "split"))
        assert split == straight, name
        assert any(row.get("train/grad_norm", 0) > 0 for row in straight), name  # the model did learn
