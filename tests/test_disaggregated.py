"""Disaggregated and asynchronous GRPO (parallel.rollout_ranks, algorithm.max_staleness): the weight
hand-over across layouts, the synchronous split equal to the colocated run, stale rollouts that learn
within their bound, and generation ranks that die or freeze."""

import json
import subprocess
import sys
import time

import pytest

from megatron_rl.checkpointing import checkpoint_dir
from tests.helpers import ROOT, column, launch_env, metrics, run_train, torchrun

pytestmark = [pytest.mark.xdist_group("tiny_sft"),  # one worker trains the shared tiny_sft run
              pytest.mark.fp32("equalities of the hand-over and of the synchronous split at fp32 precision")]

QUICK = ["logging.progress=false", "logging.tensorboard=false", "data.num_train=2000"]
SPLIT = ["parallel.rollout_ranks=1", "model.vocab_size=32"]
HAND_OVER = {  # case -> the recipe and the training layout (three ranks: two train, one generates at TP1)
    "tp2": ["tiny_grpo", "parallel.tp=2"],
    "pp2": ["tiny_grpo", "parallel.pp=2"],
    "moe-ep2-bf16": ["tiny_moe_grpo", "parallel.ep=2", "train.precision=bf16"],
    "lora-tp2": ["tiny_grpo_lora", "parallel.tp=2", "checkpoint.load="],
    "hybrid-tp2-sp": ["tiny_nemotron_h_grpo", "parallel.tp=2", "parallel.sp=true"],
}


def test_hand_over_equals_a_fresh_build(tmp_path):
    """The generation rank's copy after the hand-over equals, bit for bit, a fresh build in its layout (TP1,
    one stage, EP1) loaded from the trainers' checkpoint: TP2 (gated MLP, grouped-query attention), PP2,
    MoE experts at EP2 (bf16), LoRA merged at TP2, and a Mamba hybrid with MoE at TP2 + SP."""
    cases = [["--recipe", recipe, *SPLIT, *layout] for recipe, *layout in HAND_OVER.values()]
    proc = subprocess.run([*torchrun(3), "tests/scripts/hand_over.py", str(tmp_path), json.dumps(cases)], cwd=ROOT,
                          env=launch_env(3), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == list(range(len(HAND_OVER)))
    for name, r in zip(HAND_OVER, results):
        assert r["tensors"] >= 15 and r["different"] == [] and r["mb"] > 1.5, (name, r)


@pytest.fixture(scope="module")
def sft_checkpoint(sft_run):
    return checkpoint_dir(sft_run, 2000)


def test_synchronous_split_equals_the_colocated_run(sft_checkpoint, tmp_path):
    """algorithm.max_staleness=0 with one generation rank and one training rank: every step trains on
    rollouts of its own weights, and its metrics equal a single colocated process's bit for bit (same
    prompts, same sampling seeds, weights handed over exactly); validation runs on the generation rank."""
    run = ["--recipe", "tiny_grpo", *QUICK, "train.max_steps=3", "train.eval_every=3", "checkpoint.save=false",
           "data.num_val=64", f"checkpoint.load={sft_checkpoint}"]
    run_train([*run, f"logging.run_dir={tmp_path / 'colocated'}"])
    run_train([*run, "parallel.rollout_ranks=1", f"logging.run_dir={tmp_path / 'split'}"], nproc=2)
    split, colocated = metrics(tmp_path / "split"), metrics(tmp_path / "colocated")
    extra = {"rollout/staleness_mean", "rollout/staleness_max", "rollout/weight_version"}
    assert [{k: v for k, v in r.items() if not k.startswith("perf/") and k not in extra} for r in split] == \
        [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in colocated]
    assert column(tmp_path / "split", "rollout/weight_version") == [0, 1, 2]
    assert set(column(tmp_path / "split", "rollout/staleness_max")) == {0}
    assert all(r["perf/refit_mb"] > 1 and r["perf/refit_s"] > 0 for r in split[1:])


def test_one_step_off_policy_learns_within_its_staleness(sft_run, tmp_path):
    """tiny_grpo_async (one generation rank samples the next batch while one training rank trains, decoupled
    objective): every step trains on rollouts exactly one step old (the first on its own weights' rollouts),
    and 8 steps from tiny_sft raise held-out accuracy as tiny_grpo's variants do (+5 points)."""
    run_train(["--recipe", "tiny_grpo_async", *QUICK, "train.max_steps=8", "train.eval_every=8", "checkpoint.save=false",
               "data.num_val=256", f"checkpoint.load={sft_run}", f"logging.run_dir={tmp_path}"], nproc=2)
    assert column(tmp_path, "rollout/staleness_max") == [0, *[1] * 7]
    assert column(tmp_path, "rollout/weight_version") == [0, 0, 1, 2, 3, 4, 5, 6]
    accuracy = column(tmp_path, "val/accuracy")
    assert accuracy[-1] >= accuracy[0] + 0.05, accuracy
    assert "train/mismatch_masked_frac" in metrics(tmp_path)[-1]  # the behaviour weights are in the loss


@pytest.mark.parametrize("fault", ["kill", "sleep"])
def test_a_dead_or_frozen_generation_rank_stops_the_job(fault, tmp_path):
    """The generation rank is SIGKILLed after three steps, or sleeps forever making its fourth batch: every
    process ends within the watchdog's bound (a frozen rank: of train.hang_timeout_s passing), rank 1 named."""
    run = ["--recipe", "tiny_grpo_async", *QUICK, "checkpoint.load=", "train.max_steps=200", "train.eval_every=0",
           "checkpoint.save=false", "train.hang_timeout_s=10", f"logging.run_dir={tmp_path}"]
    script = ["tests/scripts/faulty_train.py", "1", "sleep@4"] if fault == "sleep" else ["train.py"]
    proc = subprocess.Popen([*torchrun(2), *script, *run], cwd=ROOT, env=launch_env(2), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    while len(metrics(tmp_path) if (tmp_path / "metrics.jsonl").exists() else []) < 3:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    if fault == "kill":
        import os
        import signal

        from tests.test_faults import _rank_pid
        os.kill(_rank_pid(tmp_path, 1), signal.SIGKILL)
    t0 = time.time()
    _, err = proc.communicate(timeout=150)
    assert proc.returncode != 0 and time.time() - t0 < 60, err[-3000:]
    if fault == "kill":  # torchrun ends the job and names the rank (the watchdog would, where it did not)
        assert "rank      : 1 (local_rank: 1)" in err or "rank 1 stopped answering" in err, err[-3000:]
    else:
        assert err.count("rank 1 stopped first, in phase 'rollout'") == 1, err[-3000:]
    if sys.platform.startswith("linux"):
        from tests.test_faults import _processes_of
        assert not _processes_of(tmp_path)


@pytest.mark.parametrize("off_policy", ["decoupled", "rollout_ratio"])
def test_off_policy_objectives_by_hand(one_process, off_policy):
    """The loss of one microbatch with stale rollouts, against the formulas written out here. decoupled
    (AReaL): min(p_prox / mu, C) x min(r A, clip(r) A), r = p / p_prox; rollout_ratio: min(r A, clip(r) A),
    r = p / mu; token mean. Values and gradients with respect to the logits."""
    import torch

    from megatron_rl.config import apply_overrides
    from megatron_rl.training.policy import policy_gradient_loss
    from recipes import get_recipe

    cfg = apply_overrides(get_recipe("tiny_grpo_async"), ["model.vocab_size=16", f"algorithm.off_policy={off_policy}",
                                                          "algorithm.mismatch_threshold=1.5"])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 16, (3, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float)
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    prox = logp.detach() + 0.3 * torch.randn(3, 5, generator=g)
    behaviour = prox + 0.6 * torch.randn(3, 5, generator=g)
    advantages = torch.tensor([1.0, -0.5, 2.0])
    batch = {"tokens": labels, "labels": labels, "loss_mask": mask, "advantages": advantages, "old_logp": prox,
             "rollout_logp": behaviour}
    num, den, _ = policy_gradient_loss(cfg, batch, logits)
    old = prox if off_policy == "decoupled" else behaviour
    ratio = (logp - old).exp()
    a = advantages[:, None]
    objective = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    if off_policy == "decoupled":
        objective = objective * (prox - behaviour).exp().clamp(max=1.5)
    expected = -(objective * mask).sum() / mask.sum()
    assert torch.allclose(num / den, expected, rtol=1e-6)
    (got,) = torch.autograd.grad(num / den, logits, retain_graph=True)
    (want,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-8)


def test_one_step_off_policy_resumes_without_training_a_prompt_twice(tmp_path):
    """kill -9 of torchrun in the middle of a k=1 run, then checkpoint.resume=auto: the batches sampled ahead
    of the checkpoint are lost and sampled again from its data position with its weights (the first step
    after the resume trains on rollouts of its own weights), so every step's prompts start where the last
    trained step's ended (the trainer checks it for every batch), each step is logged once, and the run ends
    at the data position of an uninterrupted run."""
    import os
    import signal

    from megatron.core import dist_checkpointing

    from megatron_rl.checkpointing import latest_checkpoint

    run = ["--recipe", "tiny_grpo_async", *QUICK, "checkpoint.load=", "train.max_steps=8", "train.eval_every=0",
           "algorithm.prompts_per_step=8", "rollout.n=4", "data.micro_batch_size=16", "checkpoint.save_every=2",
           f"logging.run_dir={tmp_path}"]
    proc = subprocess.Popen([*torchrun(2), "train.py", *run], cwd=ROOT, env=launch_env(2), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    while not (tmp_path / "checkpoints" / "step_0000004").exists():
        assert proc.poll() is None
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    at = int(latest_checkpoint(tmp_path).name.removeprefix("step_"))  # 4, or 6 if it was quicker
    run_train([*run, "checkpoint.resume=true"], nproc=2)
    rows = [r for r in metrics(tmp_path) if "train/loss" in r]  # (step 0: the starting point's validation)
    assert [r["step"] for r in rows] == list(range(1, 9))
    resumed = rows[at]  # the first step after the checkpoint
    assert resumed["rollout/staleness_max"] == 0 and resumed["rollout/weight_version"] == at
    assert all(r["rollout/staleness_max"] == 1 for r in rows[at + 1:])
    final = dist_checkpointing.load_common_state_dict(str(checkpoint_dir(tmp_path, 8)))
    assert final["extra"]["data"] == {"consumed": 8 * 8}


def test_a_preempted_generation_rank_stops_the_job_which_resumes(tmp_path):
    """SIGUSR1 to the generation rank alone (a scheduler's notice): the training rank learns of it with the
    next batch, finishes that step, saves and stops both sides (exit 0); checkpoint.resume=auto then goes on
    to the end, each step logged once."""
    import os
    import signal

    from megatron_rl.checkpointing import latest_checkpoint
    from tests.test_faults import _rank_pid

    run = ["--recipe", "tiny_grpo_async", *QUICK, "checkpoint.load=", "train.max_steps=12", "train.eval_every=0",
           "algorithm.prompts_per_step=8", "rollout.n=4", "data.micro_batch_size=16", "checkpoint.resume=auto",
           f"logging.run_dir={tmp_path}"]
    proc = subprocess.Popen([*torchrun(2), "train.py", *run], cwd=ROOT, env=launch_env(2), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    while len(metrics(tmp_path) if (tmp_path / "metrics.jsonl").exists() else []) < 3:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    os.kill(_rank_pid(tmp_path, 1), signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped = int(latest_checkpoint(tmp_path).name.removeprefix("step_"))
    assert 2 <= stopped < 12
    run_train(run, nproc=2)
    assert [r["step"] for r in metrics(tmp_path) if "train/loss" in r] == list(range(1, 13))


def test_moe_routes_of_the_generation_copy_are_replayed_per_pipeline_stage(tmp_path):
    """tiny_moe_grpo trained at PP2 from one generation rank (one stage): each training stage replays
    its own layers' routes of the generation copy's (all layers, matched by layer number): every token
    routed as in the rollout, and the rollout's logprobs equal the training forward's (fp32)."""
    run_train(["--recipe", "tiny_moe_grpo", *QUICK, "checkpoint.load=", "parallel.rollout_ranks=1", "parallel.pp=2",
               "train.max_steps=2", "train.eval_every=0", "checkpoint.save=false", "data.num_val=16",
               f"logging.run_dir={tmp_path}"], nproc=3)
    assert column(tmp_path, "moe/routing_replay_frac") == [1.0, 1.0]
    assert max(column(tmp_path, "rollout/logprob_mismatch_max")) <= 1e-5


def test_bad_input_found_by_a_generation_rank_is_one_sentence(tmp_path):
    """Only the generation ranks build the reward function of a split job: one they cannot load is said once,
    by job rank 0 (a training rank), and nothing is left in the run directory."""
    proc = subprocess.run([*torchrun(2), "train.py", "--recipe", "tiny_grpo", *QUICK, "parallel.rollout_ranks=1",
                           "rewards.fn=nope_mod:score", "checkpoint.load=", f"logging.run_dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=launch_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert said == ["error: rewards.fn='nope_mod:score' cannot be loaded (No module named 'nope_mod'); check the "
                    "module path and name."], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
