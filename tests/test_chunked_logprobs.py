"""data.logprob_chunk_tokens: log-probabilities from the output layer's input in chunks equal the whole
logits' (megatron's vocab_parallel_cross_entropy), values and gradients, at every layout."""

import os
import subprocess
import sys

import pytest

from megatron_rl.checkpointing import checkpoint_dir
from tests.helpers import ROOT, column, processes, run_recipes, run_train

# Random hidden states and an output weight over a padded vocabulary (13 of 16 entries real): log p of
# labels, its gradients, entropy and argmax, whole against chunked (7 tokens a chunk, so the last is short),
# the weight's gradient both as a tensor and accumulated into a gradient buffer (megatron's main_grad).
FUNCTIONS = """
import torch
from megatron_rl import platform
platform.init_distributed()
platform.init_model_parallel()
from megatron_rl.training.chunked import ChunkedLogits
from megatron_rl.training.logprobs import (argmax_equals, entropy, logprobs_at, mask_padded_vocab, token_logprobs,
                                           vocab_topk)

g = torch.Generator().manual_seed(0)
hidden, weight = torch.randn(3, 10, 8, generator=g), torch.randn(16, 8, generator=g)
labels = torch.randint(0, 13, (3, 10), generator=g)

threshold = (hidden @ weight.T)[..., :13].topk(5, dim=-1).values[..., -1] - 1e-3  # a top-k=5 sampler's kept set

def run(chunk, buffer=False, kept=None):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if buffer:
        w.main_grad = torch.zeros_like(w)
    logits = mask_padded_vocab(ChunkedLogits(h, w, chunk) if chunk else h @ w.T, 13)
    hit, ent = argmax_equals(logits.detach(), labels), entropy(logits)
    lp = token_logprobs(logits, labels, kept)
    (lp * torch.linspace(0.5, 1.5, 30).view(3, 10)).sum().backward()
    return lp.detach(), h.grad, w.main_grad if buffer else w.grad, hit, ent

def run_at(chunk):  # distillation: log-probs at the top-k ids and sum p log p, both in the loss
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = mask_padded_vocab(ChunkedLogits(h, w, chunk) if chunk else h @ w.T, 13)
    values, ids = vocab_topk(logits, 4)
    at, neg_entropy = logprobs_at(logits, ids)
    (at.exp().sum() + 0.3 * neg_entropy.sum()).backward()
    return at.detach(), neg_entropy.detach(), h.grad, w.grad, values, ids

def relative(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()

whole = run(0)
for chunked in (run(7), run(7, buffer=True)):
    rel = [relative(a, b) for a, b in zip(whole[:3], chunked[:3])]
    assert rel[0] < 1e-6 and rel[1] < 1e-5 and rel[2] < 1e-5, rel
    assert torch.equal(whole[3], chunked[3]) and torch.allclose(whole[4], chunked[4], rtol=1e-6, atol=1e-7)
whole = run(0, kept=threshold)  # the kept set replayed (tests/test_sampling_mask.py)
rel = [relative(a, b) for a, b in zip(whole[:3], run(7, kept=threshold)[:3])]
assert rel[0] < 1e-6 and rel[1] < 1e-5 and rel[2] < 1e-5 and not torch.equal(whole[0], run(0)[0]), rel
whole, chunked = run_at(0), run_at(7)
rel = [relative(a, b) for a, b in zip(whole[:4], chunked[:4])]
assert rel[0] < 1e-6 and rel[1] < 1e-6 and rel[2] < 1e-5 and rel[3] < 1e-5, rel
assert torch.equal(whole[5], chunked[5]) and torch.allclose(whole[4], chunked[4], rtol=1e-6)
print("ok")
"""


def test_chunked_functions_equal_the_whole_logits(tmp_path):
    script = tmp_path / "functions.py"
    script.write_text(FUNCTIONS)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


FAST = ["data.num_train=2000", "data.micro_batch_size=32", "data.num_val=128", "train.eval_every=0",
        "scheduler.decay_steps=100", "logging.progress=false", "logging.tensorboard=false", "checkpoint.save=false"]
CHUNK = ["data.logprob_chunk_tokens=100"]  # 32 x 15 tokens a microbatch: 5 chunks, the last short


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Initial weights (tiny_sft after one step), one process's 3 steps from them with the whole logits,
    and in chunks, also packed (each in one process, run one after another)."""
    root = tmp_path_factory.mktemp("chunked")
    run_train(["--recipe", "tiny_sft", *FAST, "checkpoint.save=true", "train.max_steps=1",
               f"logging.run_dir={root / 'init'}"])
    start = [f"checkpoint.load={checkpoint_dir(root / 'init', 1)}", "train.max_steps=3"]
    runs = {"whole": [], "chunked": CHUNK, "packed": [*CHUNK, "data.max_tokens_per_microbatch=256"]}
    grpo = ["--recipe", "tiny_grpo", *FAST, start[0], "train.max_steps=2", "algorithm.prompts_per_step=8",
            "rollout.top_p=0.8"]  # with the sampler's kept sets replayed
    distill = ["--recipe", "tiny_distill", *FAST, start[0], "train.max_steps=2", "algorithm.prompts_per_step=8",
               f"distill.teacher={root / 'init'}"]  # the student's own start as teacher: any teacher will do
    run_recipes([["--recipe", "tiny_sft", *FAST, *start, *extra, f"logging.run_dir={root / name}"]
                 for name, extra in runs.items()]
                + [[*grpo, *extra, f"logging.run_dir={root / ('grpo_' + name)}"] for name, extra in
                   (("whole", []), ("chunked", CHUNK))]
                + [[*distill, *extra, f"logging.run_dir={root / ('distill_' + name)}"] for name, extra in
                   (("whole", []), ("chunked", CHUNK))])
    return root, start


def _same(run, whole):
    assert column(run, "train/loss") == pytest.approx(column(whole, "train/loss"), rel=1e-6, abs=1e-7)
    assert column(run, "train/grad_norm") == pytest.approx(column(whole, "train/grad_norm"), rel=1e-5)


def test_chunked_training_equals_the_whole_logits(reference):
    """SFT (also packed), GRPO at top_p=0.8, whose rollouts (the engine's gathered logits, not chunked)
    still give the training forward's logprobs over the sampler's kept sets, and distillation (the teacher's top-k and the student's log-probs at
    them with sum p log p)."""
    root, _ = reference
    for name in ("chunked", "packed"):
        _same(root / name, root / "whole")
    _same(root / "grpo_chunked", root / "grpo_whole")
    _same(root / "distill_chunked", root / "distill_whole")
    assert max(column(root / "grpo_chunked", "rollout/logprob_mismatch_max")) < 1e-5


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true"], ["parallel.cp=2"]],
                         ids=["tp2", "tp2-sp", "cp2"])
def test_chunked_layouts_equal_one_process(reference, layout, tmp_path):
    """TP's vocabulary shards (the normalizer a sum over them; without SP the hidden states' gradient is
    all-reduced, with SP reduce-scattered) and CP's sequence shards, against one process's whole logits."""
    root, start = reference
    run_train(["--recipe", "tiny_sft", *FAST, *start, *CHUNK, *layout, f"logging.run_dir={tmp_path}"],
              nproc=processes(layout))
    _same(tmp_path, root / "whole")


def test_automatic_chunk_size_and_the_planner():
    """data.logprob_chunk_tokens=-1: off while a microbatch's fp32 logits on a rank stay within 1 GiB, else
    chunks of about 256 MiB of logits; the planner counts the chunk."""
    from megatron_rl.plan import activation_bytes
    from megatron_rl.training.chunked import chunk_tokens
    from recipes import get_recipe

    cfg = get_recipe("qwen25_32b_grpo")  # 151,936 (padded 152,064) tokens, TP8, 16k tokens a microbatch
    cfg.data.logprob_chunk_tokens = -1
    chunk = chunk_tokens(cfg)
    assert chunk % 64 == 0 and 0.9 * (256 << 20) < chunk * 4 * cfg.model.vocab_size / cfg.parallel.tp <= 256 << 20
    auto = activation_bytes(cfg, 8, cfg.parallel.pp - 1)
    cfg.data.logprob_chunk_tokens = 0
    whole = activation_bytes(cfg, 8, cfg.parallel.pp - 1)
    assert whole - auto == (cfg.data.micro_batch_size * cfg.data.seq_length - chunk) * cfg.model.vocab_size * 4 // cfg.parallel.tp
    cfg.data.logprob_chunk_tokens, cfg.parallel.tp = -1, 64  # 9 MB of logits a microbatch: off
    assert chunk_tokens(cfg) == 0
