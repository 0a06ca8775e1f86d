"""tools/eval.py: the pass@k and maj@k estimators against brute-force enumeration, and a checkpoint's
greedy accuracy equal to what GRPO's validation logged."""

import itertools
import json
import random
from collections import Counter

import pytest

from megatron_rl.checkpointing import checkpoint_dir
from megatron_rl.rollout.evaluate import maj_at_k, pass_at_k
from tests.helpers import metrics, run_tool, run_train


def brute_pass(correct, k):
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def brute_maj(answers, correct, k):
    good = {}
    for a, ok in zip(answers, correct):
        good.setdefault(a, ok and a is not None)
    total, subsets = 0.0, list(itertools.combinations(range(len(answers)), k))
    for s in subsets:
        votes = Counter(answers[i] for i in s)
        top = [a for a, v in votes.items() if v == max(votes.values())]
        total += sum(good[a] for a in top) / len(top)  # a tie broken at random, in expectation
    return total / len(subsets)


def test_estimators_equal_brute_force_enumeration():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 10)
        k = rng.randint(1, n)
        answers = [rng.choice(["12", "13", "21", None, "x"]) for _ in range(n)]
        correct = [a == "12" for a in answers]
        assert pass_at_k(n, sum(correct), k) == pytest.approx(brute_pass(correct, k), abs=1e-12)
        assert maj_at_k(answers, correct, k) == pytest.approx(brute_maj(answers, correct, k), abs=1e-12)
    assert pass_at_k(16, 0, 4) == 0.0 and pass_at_k(16, 13, 4) == 1.0 and pass_at_k(4, 1, 1) == 0.25
    assert maj_at_k(["1", "2"], [True, False], 2) == 0.5  # a tie
    assert maj_at_k([None, None, "3"], [False, False, True], 3) == 0.0  # nothing extracted can win, never right
    with pytest.raises(ValueError):
        pass_at_k(4, 2, 5)
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True], 2)


@pytest.mark.xdist_group("tiny_sft")  # starts from the shared tiny_sft run
def test_eval_tool_greedy_accuracy_equals_grpo_validation(sft_run, tmp_path):
    run = tmp_path / "grpo"
    run_train(["--recipe", "tiny_grpo", "train.max_steps=1", "train.eval_every=0", "logging.progress=false",
               "logging.tensorboard=false", "data.num_val=64", "data.num_train=2000",
               f"checkpoint.load={checkpoint_dir(sft_run, 2000)}", f"logging.run_dir={run}"])
    logged = [m["val/accuracy"] for m in metrics(run) if m["step"] == 1][0]
    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    proc = run_tool("eval.py", ["--checkpoint", str(run), "--data", str(run / "data" / "val.jsonl"), "--n", "4", "--k", "1,2,4",
                     "--out", str(out), "--samples", str(samples)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["greedy_accuracy"] == logged  # the same engine, settings, reward and prompts
    assert result["prompts"] == 64 and result["reward"] == "exact_match"
    assert result["sampling"]["max_new_tokens"] == 5  # the run's own rollout settings
    assert result["pass@1"] == pytest.approx(result["sample_accuracy"])
    assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
    assert "maj@4" in result and set(result["versions"]) >= {"torch", "megatron-core", "transformers"}
    lines = [json.loads(x) for x in samples.read_text().splitlines()]
    assert len(lines) == 64 * (1 + 4)
    assert all(x["reward"] == float(x["extracted_answer"] == x["reference"]) for x in lines)  # named for what they are
    mean = sum(x["reward"] for x in lines if not x["greedy"]) / (64 * 4)
    assert mean == pytest.approx(result["reward_mean"])
    assert "greedy_accuracy" in proc.stdout and "pass@4" in proc.stdout

    tp2 = tmp_path / "tp2.json"  # any layout under torchrun
    proc = run_tool("eval.py", ["--checkpoint", str(run), "--data", str(run / "data" / "val.jsonl"), "--tp", "2",
                     "--out", str(tp2)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert abs(json.loads(tp2.read_text())["greedy_accuracy"] - logged) <= 2 / 64  # TP rounds differently

    for bad, words in ((["--n", "4", "--k", "8"], "every k must be between 1 and --n"),
                       (["--data", str(tmp_path / "missing.jsonl")], "does not exist")):
        args = ["--checkpoint", str(run), "--data", str(run / "data" / "val.jsonl"), *bad, "--out", str(tmp_path / "x.json")]
        proc = run_tool("eval.py", args)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "x.json").exists()
