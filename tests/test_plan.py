"""tools/plan.py: exact byte counts (checked against a real tiny model) and the large recipes fit."""

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

LARGE = ["qwen3_30b_a3b_grpo", "qwen3_235b_a22b_grpo", "deepseek_v3_grpo", "nemotron_grpo"]


def _plan(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/plan.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"})


def test_plan_bytes_equal_real_allocations(tmp_path):
    proc = subprocess.run([sys.executable, "tests/scripts/plan_vs_real.py", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (planned, real) in counts.items():
        assert planned == real, (name, planned, real)


def test_large_recipes_build_and_fit():
    proc = _plan(*(arg for name in LARGE for arg in ("--recipe", name)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    totals = {name: float(params) for name, params in
              re.findall(r"recipe (\w+): .*?model ([\d.]+)B parameters", proc.stdout)}
    # the published sizes: 30.5B, 235B, 671B (without the MTP layer), 340B
    assert totals == {"qwen3_30b_a3b_grpo": 30.5, "qwen3_235b_a22b_grpo": 235.1, "deepseek_v3_grpo": 671.0,
                      "nemotron_grpo": 341.0}
    assert proc.stdout.count("FITS: the fullest rank") == len(LARGE)


# The GB200 layouts the recipes' docstrings give.
GB200 = {"qwen3_30b_a3b_grpo": ["parallel.dp=4", "algorithm.prompts_per_step=32"],
         "qwen3_235b_a22b_grpo": ["--world-size", "64", "parallel.pp=4", "parallel.first_stage_layers=23",
                                  "parallel.last_stage_layers=23", "parallel.dp=4"],
         "deepseek_v3_grpo": ["--world-size", "128", "parallel.tp=4", "parallel.dp=4", "parallel.ep=16"],
         "nemotron_grpo": ["--world-size", "96", "parallel.pp=6", "parallel.dp=2"]}


@pytest.mark.parametrize("recipe", LARGE)
def test_gb200_layouts_in_the_docstrings_fit(recipe):
    import recipes.large

    args = GB200[recipe]
    doc = " ".join(getattr(recipes.large, recipe).__doc__.split())
    for arg in args:
        if arg.startswith("parallel.") or arg.startswith("algorithm."):
            assert arg in doc, f"{recipe}'s docstring does not give {arg}"
    proc = _plan("--recipe", recipe, "--gpu", "gb200", *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_plan_says_when_it_does_not_fit():
    proc = _plan("--recipe", "qwen3_30b_a3b_grpo", "parallel.ep=2")  # 64 experts per GPU
    assert proc.returncode == 1
    assert "DOES NOT FIT" in proc.stdout and "raise tp/pp/ep" in proc.stdout
    bad = _plan("--recipe", "qwen3_30b_a3b_grpo", "parallel.ep=3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("error: parallel.ep x expert tensor parallel = 3 x 1")
