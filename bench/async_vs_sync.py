"""GRPO on the same 2 processes, colocated against disaggregated and one step off-policy.

    python bench/async_vs_sync.py [--shape tiny|trl] [--steps 8] [--repeats 3]

colocated: `torchrun --nproc_per_node 2 train.py ... parallel.dp=2`: each rank rolls out half the batch,
then both train (data parallel). disaggregated: `parallel.rollout_ranks=1 algorithm.max_staleness=1`:
rank 1 samples the next batch while rank 0 trains on the last one, the weights handed over after each
step. One thread per process, equal work (the same prompts per step, samples, tokens, optimizer steps),
the two sides alternating --repeats times (never at once). Per run: samples per second over steps
2.. (the first warms up), from each step's phase times in metrics.jsonl; the ratio is the median over
pairs of adjacent runs. Also each side's split of a step: generation, hand-over, waiting, old logprobs,
training.

Shapes: tiny, tiny_grpo itself (32 prompts x 8, up to 5 new tokens) on random weights of its 0.4M-
parameter model; trl, bench/grpo_vs_trl.py's (a 25.2M-parameter Qwen3-shaped model, 8 prompts x 8, up
to 64 new tokens, random weights so completions run to a random length).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIDES = {"colocated": ["parallel.dp=2"],
         "disaggregated": ["parallel.rollout_ranks=1", "algorithm.max_staleness=1", "algorithm.off_policy=decoupled"]}


def workload(shape: str, work: Path, steps: int) -> list[str]:
    """The train.py arguments both sides share."""
    common = ["--recipe", "tiny_grpo", "checkpoint.load=", "checkpoint.save=false", "train.eval_every=0",
              f"train.max_steps={steps}", "train.threads=1", "logging.progress=false", "logging.tensorboard=false",
              "train.hang_timeout_s=0"]
    if shape == "tiny":
        return [*common, "data.num_train=2000", "data.num_val=8"]
    from bench.grpo_vs_trl import make_workload

    w = make_workload(work, 8, 8, steps)
    return [*common, f"model.hf_path={w['model']}", "data.task=", f"data.train_path={w['train']}", "data.val_path=",
            "rewards.fn=exact_match", "algorithm.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=64",
            "data.seq_length=128", "rollout.max_sequence_length=144", "rollout.max_requests=64",
            "data.micro_batch_size=16", "data.max_tokens_per_microbatch=1024", "optimizer.lr=1e-6",
            "optimizer.min_lr=1e-6"]


def run(side: str, args: list[str], work: Path) -> dict:
    run_dir = work / f"{side}_{time.time_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py", *args,
           *SIDES[side], f"logging.run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r][1:]  # the first step warms up
    split = {k: statistics.mean(r.get(k, 0.0) for r in steps) for k in
             ("perf/time_rollout_s", "perf/time_logprob_s", "perf/time_train_s", "perf/refit_s", "perf/generation_s")}
    step_s = statistics.mean(r["perf/time_rollout_s"] + r["perf/time_logprob_s"] + r["perf/time_train_s"] for r in steps)
    return {"step_s": step_s, "split": split, "tokens": statistics.mean(r["rollout/response_len_mean"] for r in steps)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["tiny", "trl"], default="tiny")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        common = workload(args.shape, work, args.steps)
        samples = 8 * 8 if args.shape == "trl" else 32 * 8
        runs = {side: [] for side in SIDES}
        for i in range(args.repeats):
            for side in (SIDES if i % 2 == 0 else reversed(list(SIDES))):
                runs[side].append(run(side, common, work))
                r = runs[side][-1]
                print(f"{side:14s} run {i + 1}: {r['step_s']:.3f} s/step, {samples / r['step_s']:.1f} samples/s",
                      flush=True)
    ratios = [c["step_s"] / d["step_s"] for c, d in zip(runs["colocated"], runs["disaggregated"])]
    print(f"\nshape {args.shape}: {samples} samples a step, {args.steps} steps a run (steps 2.. timed), "
          f"{args.repeats} runs a side, alternating")
    for side, rs in runs.items():
        step = statistics.median(r["step_s"] for r in rs)
        split = {k.removeprefix("perf/").removesuffix("_s"): statistics.median(r["split"][k] for r in rs)
                 for k in rs[0]["split"]}
        print(f"{side:14s} {step:.3f} s/step  {samples / step:7.1f} samples/s  mean completion "
              f"{statistics.mean(r['tokens'] for r in rs):.1f} tokens  split (median s): "
              + ", ".join(f"{k} {v:.3f}" for k, v in split.items() if v))
    print(f"disaggregated / colocated samples per second: {statistics.median(ratios):.2f}x "
          f"(pairs {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
