"""A dead or frozen rank never hangs the job.

Collectives wait for every rank, and their timeouts are long on purpose (a rank may legitimately
wait for a slower one's rollouts or a save). So instead of shortening them, every rank runs a
watchdog thread that talks through the process group's store:

- each rank's main thread calls `beat(phase)` as it works (phase boundaries, microbatches, rollout
  engine steps, the optimizer step before its collectives); its watchdog publishes the time of the
  last beat and a sign of life every few seconds;
- rank 0's watchdog reads everyone's: a rank whose watchdog stopped publishing has died; and if no
  rank has beaten for `timeout` seconds (none makes progress, so none is waiting for a slow peer),
  the rank whose last beat is oldest is frozen (the others went on to wait in a collective), passing
  over ranks whose phase says they wait for others ("waiting ...": a disaggregated job's sides);
- a rank that raises (train.py) or a verdict of rank 0 sets the store's abort key: every watchdog
  sees it within seconds and ends its process (exit 1). The rank that failed prints its error;
  a frozen rank prints its stacks; the others leave quietly.

Phases that may run long without beating (setting up: building, importing and loading the model,
until the first step; a checkpoint save of a large model inside `patient()`) are exempt: no rank is
called frozen while one is in such a phase.
"""

import contextlib
import faulthandler
import os
import sys
import threading
import time

ABORT = "watchdog/abort"
WAITING = "waiting"  # a phase that begins so waits for other ranks' work: never the one called frozen
_state = {"time": time.time(), "phase": "setup", "patient": 1, "setup": True,  # until steps_started()
          "stopping": False}
_store = None  # set while a watchdog runs


def beat(phase: str):
    """Progress of this rank's main thread (cheap: no I/O)."""
    _state["time"] = time.time()
    _state["phase"] = phase


def steps_started():
    """The run's first step begins: the setup, which may be long without beats, is over."""
    if _state["setup"]:
        _state["setup"] = False
        _state["patient"] -= 1


@contextlib.contextmanager
def patient(phase: str):
    """A phase that may not beat for longer than the timeout (a checkpoint save or load)."""
    beat(phase)
    _state["patient"] += 1
    try:
        yield
    finally:
        _state["patient"] -= 1
        beat(f"after {phase}")


def stop():
    """The run ends normally: the watchdog goes quiet (the store may vanish from now on)."""
    _state["stopping"] = True


def running() -> bool:
    """Whether this rank runs a watchdog (more than one rank, train.hang_timeout_s > 0)."""
    return _store is not None


def abort(reason: str):
    """Tell every rank to stop (this rank failed with `reason`, already printed)."""
    if _store is not None:
        with contextlib.suppress(Exception):
            _store.set(ABORT, reason)


def peer_failed() -> bool:
    """Whether another rank asked every rank to stop (then this rank's own error is a consequence)."""
    if _store is None:
        return False
    try:
        return _store.check([ABORT])
    except Exception:  # noqa: BLE001 - the store (on rank 0) is gone: a peer died
        return True


def start(store, rank: int, world_size: int, timeout: float, barrier=None):
    """Start this rank's watchdog thread (world_size > 1; timeout 0: off). Collective: every rank
    publishes once before any watchdog reads (barrier: one over all `world_size` ranks, default
    torch.distributed's)."""
    global _store
    import torch.distributed as dist

    if world_size == 1 or timeout <= 0:
        return
    _state.update(time=time.time(), phase="setup", patient=1, setup=True, stopping=False)
    _store = store
    interval = max(0.5, min(5.0, timeout / 5))
    _publish(store, rank, 0)
    (barrier or dist.barrier)()
    threading.Thread(target=_watch, args=(store, rank, world_size, timeout, interval), name="watchdog",
                     daemon=True).start()


def _publish(store, rank: int, alive: int):
    store.set(f"watchdog/{rank}", f"{alive}|{_state['time']}|{int(_state['patient'] > 0)}|{_state['phase']}")


def _exit(message: str | None, stacks: bool = False):
    if message:
        print(message, file=sys.stderr, flush=True)
    if stacks:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    os._exit(1)


def _watch(store, rank: int, world_size: int, timeout: float, interval: float):
    dead_after = max(6 * interval, 30.0)  # generous: a long call holding the GIL also silences a watchdog
    seen = {}  # rank -> (alive count, when it last changed)
    alive = 0
    while True:
        time.sleep(interval)
        alive += 1
        if _state["stopping"]:
            return
        try:
            _publish(store, rank, alive)
            if store.check([ABORT]):
                reason = store.get(ABORT).decode()
                _exit(None, stacks=reason.startswith(f"frozen {rank}:"))
            if rank == 0:
                verdict = _judge(store, world_size, seen, timeout, dead_after)
                if verdict:
                    print("error: " + verdict.split(":", 1)[1].strip(), file=sys.stderr, flush=True)
                    store.set(ABORT, verdict)
                    if verdict.startswith("frozen 0:"):
                        _exit(None, stacks=True)
                    time.sleep(2 * interval)  # the frozen rank dumps its stacks before its peers go
                    _exit(None)
        except Exception as e:  # noqa: BLE001 - the store is hosted with rank 0 (or torchrun): it is gone
            if _state["stopping"]:
                return
            _exit(f"error: rank {rank} lost the job's store ({type(e).__name__}): rank 0 or the launcher died; "
                  "stopping")


def _judge(store, world_size: int, seen: dict, timeout: float, dead_after: float) -> str | None:
    """Rank 0: 'dead R: ...' or 'frozen R: ...' when a rank died or every rank stopped progressing."""
    now = time.monotonic()
    beats, patient = {}, False
    for r, value in enumerate(store.multi_get([f"watchdog/{r}" for r in range(world_size)])):
        alive, beat_time, is_patient, phase = value.decode().split("|", 3)
        if r not in seen or seen[r][0] != alive:
            seen[r] = (alive, now)
        if now - seen[r][1] > dead_after:
            return f"dead {r}: rank {r} stopped answering {now - seen[r][1]:.0f} s ago (its process died or " \
                   f"hangs outside Python) in phase '{phase}'; every rank stops"
        beats[r] = (float(beat_time), phase)
        patient |= is_patient == "1"
    quiet = time.time() - max(t for t, _ in beats.values())
    if patient or quiet <= timeout:
        return None
    # A rank waiting on purpose for the other side of a disaggregated job is not the one that froze
    working = [k for k in beats if not beats[k][1].startswith(WAITING)] or list(beats)
    r = min(working, key=lambda k: beats[k][0])
    return f"frozen {r}: no rank made progress for {quiet:.0f} s (train.hang_timeout_s={timeout:g}); rank {r} " \
           f"stopped first, in phase '{beats[r][1]}' (its stacks follow); every rank stops"
