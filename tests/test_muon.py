"""Muon (optimizer.name=muon): its update is torch.optim.Muon's on whole matrices, every layout equals one
process, and it resumes bitwise."""

import os
import shutil
import subprocess
import sys

import pytest

from megatron_rl.checkpointing import checkpoint_dir
from tests.helpers import ROOT, column, launch_env, processes, run_train, torchrun

# Two optimizer steps of the default tiny model from given gradients, beside torch's own optimizers on
# copies of its parameters: torch.optim.Muon for the matrices, torch.optim.AdamW for the rest.
ONE_STEP = """
import sys, torch
from megatron_rl import platform
from megatron_rl.config import Config
from megatron_rl.training.muon import is_matrix, newton_schulz
from megatron_rl.training.setup import build_trainee
from megatron_rl.training.step import optimizer_step, zero_grads

platform.init_distributed()
platform.init_model_parallel()
cfg = Config()
cfg.model.vocab_size = 16
o = cfg.optimizer
o.name, o.muon_ns_dtype, o.lr, o.weight_decay, o.clip_grad = "muon", sys.argv[1], 0.02, 0.1, 0.0
o.muon_lr_scale = "original"
trainee = build_trainee(cfg)
named = dict(trainee.model[0].module.named_parameters())
matrices = {n for n, p in named.items() if is_matrix(p)}
muon_params = {id(p) for sub in trainee.optimizer.chained_optimizers if isinstance(sub.optimizer, torch.optim.Muon)
               for g in sub.optimizer.param_groups for p in g["params"]}
assert {n for n, p in named.items() if id(p) in muon_params} == matrices
assert "embedding.word_embeddings.weight" not in matrices and "output_layer.weight" not in matrices
assert any("linear_qkv.weight" in n for n in matrices) and not any(p.ndim != 2 for n, p in named.items() if n in matrices)
copies = {n: p.detach().clone().requires_grad_() for n, p in named.items()}
mine = [copies[n] for n in named if n in matrices]
others = [copies[n] for n in named if n not in matrices]
muon = torch.optim.Muon(mine, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                        nesterov=o.muon_nesterov, ns_coefficients=tuple(o.muon_ns_coefficients),
                        ns_steps=o.muon_ns_steps, adjust_lr_fn="original")
adam = torch.optim.AdamW([{"params": [p], "weight_decay": 0.0 if p.ndim == 1 else o.weight_decay} for p in others],
                         lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
for k in range(2):
    zero_grads(trainee)
    lr = trainee.optimizer.param_groups[0]["lr"]
    for i, (n, p) in enumerate(named.items()):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * i + k))
        p.main_grad.copy_(g)
        copies[n].grad = g.clone()
    for group in muon.param_groups + adam.param_groups:
        group["lr"] = lr
    optimizer_step(trainee)
    muon.step()
    adam.step()
worst = max((named[n] - copies[n]).abs().max().item() for n in matrices)
adam_worst = max((named[n] - copies[n]).abs().max().item() for n in named if n not in matrices)
print("worst", worst, adam_worst)
# fp32 Newton-Schulz is the same iteration as torch's bf16 one: equal to bf16's precision
x = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
fp32, bf16 = newton_schulz(x, o.muon_ns_coefficients, 5, 1e-7, torch.float32), newton_schulz(x, o.muon_ns_coefficients, 5, 1e-7, torch.bfloat16)
print("ns", ((fp32 - bf16.float()).norm() / fp32.norm()).item())
"""


def _one_step(tmp_path, ns_dtype: str) -> dict:
    script = tmp_path / "one_step.py"
    script.write_text(ONE_STEP)
    out = subprocess.run([sys.executable, str(script), ns_dtype], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("worst", "ns")))
    return {k: [float(x) for x in v.split()] for k, v in lines.items()}


def test_muon_steps_as_torch_muon_on_the_matrices_and_adam_on_the_rest(tmp_path):
    """Two steps (momentum, Nesterov, weight decay, the shape's lr scale) from the same gradients: bf16
    Newton-Schulz is torch.optim.Muon's to the bit, the rest torch's AdamW; the fp32 iteration agrees with
    the bf16 one to bf16's precision, and its steps to a few bf16 roundings of the update."""
    bf16 = _one_step(tmp_path, "bf16")
    assert bf16["worst"] == [0.0, 0.0], bf16
    fp32 = _one_step(tmp_path, "fp32")
    assert 0 < fp32["worst"][0] < 0.02 * 0.05 and fp32["worst"][1] == 0.0, fp32
    assert 0 < fp32["ns"][0] < 5e-2, fp32


FAST = ["data.num_train=2000", "data.micro_batch_size=32", "data.num_val=128", "train.eval_every=0",
        "scheduler.decay_steps=100", "logging.progress=false", "logging.tensorboard=false",
        "optimizer.name=muon", "optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Initial weights (tiny_sft after one step), and one process's 4 Muon steps from them, saved at 2."""
    root = tmp_path_factory.mktemp("muon")
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=1", f"logging.run_dir={root / 'init'}"])
    ckpt = checkpoint_dir(root / "init", 1)
    single = root / "single"
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=4", f"checkpoint.load={ckpt}",
               "checkpoint.save_every=2", "checkpoint.keep=0", f"logging.run_dir={single}"])
    return ckpt, single


def _resumes_bitwise(run, layout):
    """The run resumed from its step-2 checkpoint repeats steps 3 and 4 to the bit."""
    resumed = run.parent / f"{run.name}_resumed"
    shutil.copytree(checkpoint_dir(run, 2), checkpoint_dir(resumed, 2))
    run_train(["--recipe", "tiny_sft", *FAST, *layout, "train.max_steps=4", "checkpoint.resume=true",
               "checkpoint.save=false", f"logging.run_dir={resumed}"], nproc=processes(layout))
    assert column(resumed, "train/loss") == column(run, "train/loss")[2:]
    assert column(resumed, "train/grad_norm") == column(run, "train/grad_norm")[2:]


def test_muon_resumes_bitwise(reference):
    _resumes_bitwise(reference[1], [])


# fp32 with another reduction order (TP's all-reduce, DP's split) over 4 Muon steps, as test_sft's layouts
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true"],
                                    ["parallel.dp=2", "optimizer.distributed=true"]],
                         ids=["tp2", "tp2-sp", "dp2-layer-wise"])
def test_muon_layouts_match_single_process(reference, layout, tmp_path):
    ckpt, single = reference
    distributed = "optimizer.distributed=true" in layout
    run_train(["--recipe", "tiny_sft", *FAST, *layout, "train.max_steps=4", f"checkpoint.load={ckpt}",
               "checkpoint.save_every=2", "checkpoint.keep=0", f"checkpoint.save={str(distributed).lower()}",
               f"logging.run_dir={tmp_path}"], nproc=processes(layout))
    assert column(tmp_path, "train/loss") == pytest.approx(column(single, "train/loss"), rel=1e-5, abs=1e-6)
    assert column(tmp_path, "train/grad_norm") == pytest.approx(column(single, "train/grad_norm"), rel=1e-4)
    if distributed:
        _resumes_bitwise(tmp_path, layout)


# Muon's distributed optimizer (megatron's layer-wise one) on 2 data-parallel processes: a step, its
# all-gather of the updated matrices and a save; each of the platform's fixes of that optimizer undone in
# turn (through its __wrapped__) must then fail.
LAYER_WISE = """
import sys, torch
from megatron_rl import checkpointing, platform
from megatron_rl.config import Config
from megatron_rl.training.setup import build_trainee
from megatron_rl.training.step import optimizer_step, zero_grads
import megatron.core.optimizer.layer_wise_optimizer as layer_wise

cls = layer_wise.LayerWiseDistributedOptimizer
for name in sys.argv[2:]:
    setattr(cls, name, getattr(cls, name).__wrapped__)
platform.init_distributed()
platform.init_model_parallel()
cfg = Config()
cfg.model.vocab_size = 16
cfg.optimizer.name, cfg.optimizer.distributed = "muon", True
trainee = build_trainee(cfg)
zero_grads(trainee)
for p in trainee.model[0].parameters():
    p.main_grad.fill_(0.01)
optimizer_step(trainee)
checkpointing.save(trainee, sys.argv[1], 1, {})
"""


@pytest.mark.parametrize("undo, error", [(["allgather_params"], "invalid tensor size"),
                                         (["sharded_state_dict"], "KeyError: 'optimizer'")],
                         ids=["without-padded-allgather", "without-fp32-checkpoint"])
def test_layer_wise_fixes_are_needed(undo, error, tmp_path):
    """(With both fixes the same steps and saves run in test_muon_layouts_match_single_process[dp2-layer-wise].)"""
    script = tmp_path / "layer_wise.py"
    script.write_text(LAYER_WISE)
    out = subprocess.run([*torchrun(2), str(script), str(tmp_path / "run"), *undo], cwd=ROOT, capture_output=True,
                         text=True, env=launch_env(2), timeout=180)
    assert out.returncode != 0 and error in out.stderr, out.stderr[-3000:]
