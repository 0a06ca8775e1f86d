"""train.py with faults injected on one rank at given optimizer steps (on a generation rank of a disaggregated
job: at given batches it makes) (tests/test_faults.py):

    torchrun --nproc_per_node 2 tests/scripts/faulty_train.py RANK FAULT@STEP[,FAULT@STEP...] [train.py arguments]

FAULT: raise (a RuntimeError), slow_raise (an error whose message takes 5 s to render, longer than the
watchdog's interval), sleep (forever, as a rank stuck in a deadlock would), or patient (15 s inside
watchdog.patient, as a long checkpoint save: a legitimate wait).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train  # noqa: E402
from megatron_rl.platform import watchdog  # noqa: E402
from megatron_rl.rollout import disaggregated  # noqa: E402
from megatron_rl.training import step as training_step  # noqa: E402

rank = int(sys.argv[1])
faults = {int(step): fault for fault, step in (f.split("@") for f in sys.argv[2].split(","))}
optimizer_step, steps = training_step.optimizer_step, [0]


class SlowToPrint(RuntimeError):
    def __str__(self):
        time.sleep(5)
        return super().__str__()


def inject():
    """The fault for this call (the STEP-th on RANK), done here or left to the caller (None, or a fault it does)."""
    steps[0] += 1
    fault = faults.get(steps[0]) if int(os.environ.get("RANK", "0")) == rank else None
    if fault in ("raise", "slow_raise"):
        raise (RuntimeError if fault == "raise" else SlowToPrint)(f"injected failure on rank {rank} at step {steps[0]}")
    if fault == "value_error":  # a bug that happens to raise ValueError is not a user's mistake
        raise ValueError(f"injected bug on rank {rank} at step {steps[0]}")
    if fault == "sleep":
        while True:
            time.sleep(1)
    if fault == "patient":
        with watchdog.patient("a long save"):
            time.sleep(15)


def faulty(trainee):
    inject()
    return optimizer_step(trainee)


def faulty_batch(self, step):
    """A generation rank of a disaggregated job (parallel.rollout_ranks): its STEP-th batch."""
    inject()
    return make_batch(self, step)


training_step.optimizer_step = faulty
make_batch, disaggregated._Generator.make = disaggregated._Generator.make, faulty_batch
if __name__ == "__main__":
    sys.exit(train.main(sys.argv[3:]))
