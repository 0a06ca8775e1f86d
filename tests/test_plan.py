"""tools/plan.py: exact byte counts (checked against a real tiny model), and what it proposes when a
layout does not fit (tests/test_recipes.py plans every large recipe)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

def _plan(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/plan.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("extra", [[], ["lora.rank=4"], ["optimizer.name=muon"]], ids=["full", "lora", "muon"])
def test_plan_bytes_equal_real_allocations(extra, tmp_path):
    proc = subprocess.run([sys.executable, "tests/scripts/plan_vs_real.py", str(tmp_path), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (planned, real) in counts.items():
        assert planned == real, (name, planned, real)
    if extra == ["lora.rank=4"]:  # LoRA: gradients and Adam state for the adapters alone, a small part of the weights
        assert counts["grads"][1] < 0.2 * counts["weights"][1] / 2 * 4
    if extra == ["optimizer.name=muon"]:  # 8 bytes (momentum, main copy) for most parameters instead of 12
        assert counts["optimizer"][1] < 0.8 * counts["grads"][1] / 4 * 12


def test_plan_says_when_it_does_not_fit():
    proc = _plan("--recipe", "qwen25_32b_grpo", "optimizer.state_dtype=fp32")
    assert proc.returncode == 1
    assert "DOES NOT FIT: the fullest rank (stage 0) needs 90.6 of 80 GB:" in proc.stdout
    assert "It fits with optimizer.state_dtype=bf16: the fullest rank needs 66.0 of 80 GB." in proc.stdout
    bad = _plan("--recipe", "qwen3_30b_a3b_grpo", "parallel.ep=3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("error: parallel.ep x expert tensor parallel = 3 x 1")


def test_generation_ranks_are_planned_apart():
    """parallel.rollout_ranks: the training ranks hold no KV cache; a generation rank holds the policy in its
    own layout (TP2 of 32 GPUs' worth of experts over EP8) and the cache, no gradients or optimizer state."""
    proc = _plan("--recipe", "qwen3_30b_a3b_grpo_async")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("0", "gen")}
    rank, layers, params, weights, grads, optimizer, activations, kv, *_ = rows["gen"]
    assert rank == 16 and layers == 48 and grads == optimizer == activations == 0 and kv > 40
    assert rows["0"][7] == 0 and rows["0"][5] > 0  # the first training rank: no KV cache, optimizer state
    assert "the first of 16 generation ranks" in proc.stdout


FIT = """
import json, sys
from megatron_rl.config import apply_overrides
from megatron_rl.plan import fit, plan
from recipes import get_recipe

out = {}
for name, overrides in json.loads(sys.argv[1]).items():
    cfg = apply_overrides(get_recipe("qwen25_32b_grpo"), overrides)
    p = plan(cfg, 0, "a100")
    found = fit(cfg, 0, "a100")
    out[name] = dict(fits=p.fits, optimizer=max(s.optimizer for s in p.stages) / 1e9,
                     overrides=found.overrides, world_size=found.world_size,
                     host=max(s.host for s in found.plan.stages) / 1e9, params=max(s.params for s in p.stages))
print(json.dumps(out))
"""


def test_planner_chooses_bf16_optimizer_state_offload_or_a_larger_layout():
    """qwen25_32b_grpo on 8 A100 80GB at TP8, DP1: fp32 Adam state alone is about 49 GB per GPU, so it
    fits only with bf16 moments (chosen: no time cost) or CPU offload; at TP4 only offload fits (the
    state goes to the host: 16 bytes per parameter); at TP2 nothing does, and the planner names the
    smallest layout that fits."""
    cases = {"fp32": ["optimizer.state_dtype=fp32"], "tp4": ["parallel.tp=4"], "tp2": ["parallel.tp=2"], "bf16": []}
    proc = subprocess.run([sys.executable, "-c", FIT, json.dumps(cases)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not r["fp32"]["fits"] and round(r["fp32"]["optimizer"]) == 49
    assert r["fp32"]["overrides"] == ["optimizer.state_dtype=bf16"] and r["fp32"]["world_size"] == 8
    assert r["bf16"]["fits"] and r["bf16"]["optimizer"] == r["fp32"]["optimizer"] / 2 and r["bf16"]["overrides"] == []
    assert not r["tp4"]["fits"]
    assert r["tp4"]["overrides"] == ["optimizer.state_dtype=fp32", "optimizer.cpu_offload=1"]
    assert r["tp4"]["host"] == 16 * r["tp4"]["params"] / 1e9
    assert r["tp2"]["overrides"][0] == "parallel.tp=4" and r["tp2"]["world_size"] == 4


OTHERS = """
import json
from megatron_rl.config import apply_overrides
from megatron_rl.plan import optimizer_bytes_per_param, plan
from recipes import get_recipe

cfg = apply_overrides(get_recipe("tiny_ppo"), ["model.vocab_size=16", "algorithm.kl_coef=0.1"])
p = plan(cfg, 1, "h100")
print(json.dumps(dict(params=p.stages[0].params, others=p.stages[0].others, names=p.others,
                      state=optimizer_bytes_per_param(cfg)[0])))
"""


def test_planner_counts_the_critic_with_its_optimizer_and_the_reference():
    """tiny_ppo with a KL penalty: beside the policy, the critic (the policy's layers and embedding, a
    (hidden -> 1) head instead of the 128-row padded output layer) with bf16 weights, fp32 gradients and
    Adam state, and the reference's bf16 weights."""
    proc = subprocess.run([sys.executable, "-c", OTHERS], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    critic = r["params"] - 128 * 128 + 128
    assert r["names"] == ["critic", "reference"]
    assert r["others"] == critic * (2 + 4 + r["state"]) + r["params"] * 2


def test_planner_counts_chunked_logits():
    """The last stage's fp32 logits: the microbatch's tokens x the vocabulary (over TP), or
    data.logprob_chunk_tokens of them at a time."""
    from megatron_rl.config import apply_overrides
    from megatron_rl.plan import activation_bytes
    from recipes import get_recipe

    cfg = get_recipe("qwen3_30b_a3b_grpo_async")
    tokens, chunk = cfg.data.micro_batch_size * cfg.data.seq_length, 1024
    chunked = apply_overrides(get_recipe("qwen3_30b_a3b_grpo_async"), [f"data.logprob_chunk_tokens={chunk}"])
    last = cfg.parallel.pp - 1
    saved = activation_bytes(cfg, 4, last) - activation_bytes(chunked, 4, last)
    assert saved == (tokens // cfg.parallel.cp - chunk) * cfg.model.vocab_size * 4 // cfg.parallel.tp > 0
