"""Nothing moves but the structure: the first steps' metrics of the main tiny recipes, recorded once and
compared after a refactor, to the bit (one thread; timings, the perf/ keys, left out).

    python tests/scripts/same_metrics.py record BASE_DIR      # on the code before the change
    python tests/scripts/same_metrics.py compare BASE_DIR     # on the code after it: exit 1 on any difference

Each recipe runs STEPS steps from a STEPS-step tiny_sft (tiny_distill from a STEPS-step tiny_teacher of it).
`compare` also starts tiny_grpo from the recorded tiny_sft checkpoint: checkpoints written before the change
still load, and give the same run.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
FROM_SFT = ["tiny_grpo", "tiny_dapo", "tiny_dpo", "tiny_ppo", "tiny_grpo_lora", "tiny_teacher"]


def train(runs: Path, recipe: str, *overrides: str, name: str | None = None) -> list[dict]:
    run_dir = runs / (name or recipe)
    cmd = [sys.executable, "train.py", "--recipe", recipe, f"logging.run_dir={run_dir}", f"train.max_steps={STEPS}",
           "train.threads=1", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def run_all(runs: Path) -> dict[str, list[dict]]:
    sft = str(runs / "tiny_sft")
    out = {"tiny_sft": train(runs, "tiny_sft")}
    for recipe in FROM_SFT:
        out[recipe] = train(runs, recipe, f"checkpoint.load={sft}")
        print(f"{recipe}: {len(out[recipe])} rows", flush=True)
    out["tiny_rm"] = train(runs, "tiny_rm", f"data.negatives_from={sft}", "data.num_train=2000")
    out["tiny_distill"] = train(runs, "tiny_distill", f"checkpoint.load={sft}", f"distill.teacher={runs / 'tiny_teacher'}")
    return out


def differences(base: dict, new: dict) -> list[str]:
    found = []
    for recipe, rows in base.items():
        if len(rows) != len(new.get(recipe, [])):
            found.append(f"{recipe}: {len(rows)} rows recorded, {len(new.get(recipe, []))} now")
            continue
        for old, now in zip(rows, new[recipe]):
            if old != now:
                keys = sorted(k for k in old.keys() | now.keys() if old.get(k) != now.get(k))
                found.append(f"{recipe} step {old.get('step')}: " + ", ".join(f"{k} {old.get(k)} -> {now.get(k)}" for k in keys))
    return found


def main():
    mode, base = sys.argv[1], Path(sys.argv[2]).resolve()
    if mode == "record":
        result = run_all(base / "runs")
        (base / "metrics.json").write_text(json.dumps(result, indent=1))
        print(f"recorded {sum(map(len, result.values()))} rows of {len(result)} recipes in {base / 'metrics.json'}")
        return
    recorded = json.loads((base / "metrics.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        now = run_all(runs)
        now["tiny_grpo from the recorded tiny_sft"] = train(runs, "tiny_grpo", f"checkpoint.load={base / 'runs' / 'tiny_sft'}",
                                                            name="grpo_old_ckpt")
    recorded["tiny_grpo from the recorded tiny_sft"] = recorded["tiny_grpo"]
    found = differences(recorded, now)
    for line in found:
        print(line)
    rows = sum(map(len, recorded.values()))
    print(f"{len(found)} differences in {rows} rows of {len(recorded)} runs ({STEPS} steps each, perf/ left out)")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
