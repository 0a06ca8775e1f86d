"""Each CPU patch in megatron_rl/platform/cpu.py: the megatron call fails without it and works with it."""

import contextlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_rl import platform
from tests.helpers import ROOT

SETUP_DIST = """
import torch, torch.distributed as dist
dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel()
"""

# name -> code that calls megatron-core where it hard-codes CUDA
CASES = {
    "cuda device literals (device='cuda')": """
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
print(get_grad_norm_fp32([torch.ones(4)], grad_stats_parallel_group=ps.get_model_parallel_group()))
""",
    "torch.cuda.current_device() as a device": """
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
print(RotaryEmbedding(8, 1.0)(4).shape)
""",
    "CUDA RNG tracker": """
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, get_cuda_rng_tracker
model_parallel_cuda_manual_seed(1)
with get_cuda_rng_tracker().fork():
    print(torch.rand(1))
""",
    "Tensor.type() == 'torch.cuda.FloatTensor' in gradient clipping": """
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)
clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=2.0)
assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5), p.grad
""",
    "torch.cuda.synchronize / streams / events": """
from megatron.core.utils import get_model_config
from megatron.core.timers import Timers
t = Timers(2, 'minmax'); t('x', log_level=0).start(barrier=False); t('x').stop(barrier=False); print(t('x').elapsed())
""",
    "pin_memory=True and .cuda()": """
from megatron.core.optimizer.grad_scaler import ConstantGradScaler
s = ConstantGradScaler(1.0); s.load_state_dict({'scale': torch.ones(1)}); print(s.scale)
""",
}


def _run(code: str, patched: bool) -> subprocess.CompletedProcess:
    from tests.helpers import free_port

    prelude = "import megatron_rl.platform\n" if patched else ""
    # destroy the group before exit: gloo's threads otherwise may abort the exit ("terminate called")
    script = prelude + SETUP_DIST.format(port=free_port()) + code + "\ndist.destroy_process_group()\n"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply only without CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_patch_is_needed_and_works(name):
    without = _run(CASES[name], patched=False)
    assert without.returncode != 0, f"{name}: megatron-core ran without the patch; is it still needed?"
    with_patch = _run(CASES[name], patched=True)
    assert with_patch.returncode == 0, with_patch.stderr[-3000:]


START_UP = """
import multiprocessing, sys
import megatron.core.models.gpt, megatron.core.inference.engines.dynamic_engine, megatron.core.timers
from megatron.core.dist_checkpointing.strategies import filesystem_async
filesystem_async._get_write_results_queue()
print(sorted(m for m in ('torch._dynamo', 'wandb') if m in sys.modules), [type(p).__name__ for p in multiprocessing.active_children()])
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="megatron's fusions stay compiled on a GPU")
def test_start_up_imports_neither_dynamo_nor_wandb_nor_spawns():
    """Three start-up costs of every process (about 5 s of a 12 s tiny run): torch.compile at import,
    wandb imported for metrics we never send there, and a spawned process to collect checkpoint writes."""
    def run(prelude):
        return subprocess.run([sys.executable, "-c", prelude + START_UP], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120).stdout.strip()

    assert run("") == "['torch._dynamo', 'wandb'] ['SpawnProcess']", "megatron changed: are these patches still needed?"
    assert run("import megatron_rl.platform\n") == "[] ['ForkProcess']"
    assert run("import megatron_rl.platform\nimport wandb\n") == "['wandb'] ['ForkProcess']"


def test_launch_from_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "1234"}
    assert platform.read_launch(env) == platform.Launch(3, 8, 1, "node7", 1234, "torchrun")


def test_launch_from_slurm_env():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
           "SLURM_NODELIST": "gpu[012-015,020]", "SLURM_JOB_ID": "4242"}
    launch = platform.read_launch(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.master_port,
            launch.launcher) == (5, 16, 5, "gpu012", 24242, "slurm")
    assert launch.nodes == ("gpu012", "gpu013", "gpu014", "gpu015", "gpu020")
    assert "16 rank(s) on 5 node(s) (gpu012, gpu013, gpu014, gpu015, ...)" in launch.describe()


def test_torchrun_inside_an_srun_step_wins():
    """One srun task per node starting torchrun: torchrun's RANK/WORLD_SIZE/MASTER_* are the job's."""
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": "node[1-2]", "SLURM_LOCALID": "0",
           "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29400"}
    assert platform.read_launch(env) == platform.Launch(9, 16, 1, "node1", 29400, "torchrun")


@pytest.mark.parametrize("nodelist,hosts", [
    ("node", ["node"]),
    ("a1,b2", ["a1", "b2"]),
    ("gpu[001-004,007]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007"]),
    ("node[01-02]-ib", ["node01-ib", "node02-ib"]),
    ("gpu[8-10],cpu1,login[3]", ["gpu8", "gpu9", "gpu10", "cpu1", "login3"]),
    ("r[1-2]n[09-10]", ["r1n09", "r1n10", "r2n09", "r2n10"]),
    ("nid[00001-00002],x-y.z", ["nid00001", "nid00002", "x-y.z"]),
])
def test_every_nodelist_form(nodelist, hosts):
    assert platform.expand_nodelist(nodelist) == hosts
    if shutil.which("scontrol"):  # what Slurm itself says, where it is installed
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0:
            assert out.stdout.split() == hosts


@pytest.mark.parametrize("env,says", [
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS and SLURM_NODELIST not"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "gpu[1-"}, "unclosed bracket"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "gpu[4-2]"}, "rising range"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "gpu]1"}, "unbalanced"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not a whole number"),
])
def test_bad_launch_environment(env, says):
    with pytest.raises(platform.LaunchError, match=re.escape(says)):
        platform.read_launch(env)


def test_single_process_default():
    """Without a launcher's variables: one process, rank 0 (it needs no port: test_bad_launch_ends_in_one_sentence)."""
    launch = platform.read_launch({"MASTER_PORT": "1234"})
    assert (launch.world_size, launch.rank, launch.launcher) == (1, 0, "single")


def test_bad_launch_ends_in_one_sentence(tmp_path):
    """An incomplete Slurm environment, and a master port already taken by a multi-process launch:
    exit code 2, one line, no traceback, nothing written. One process needs no port: it runs even
    with MASTER_PORT taken."""
    import socket

    base = [sys.executable, "train.py", "--recipe", "tiny_sft", f"logging.run_dir={tmp_path / 'run'}"]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_", "PYTHONWARNINGS"))}
    out = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, env={**clean, "SLURM_PROCID": "0"},
                         timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: SLURM_PROCID is set but SLURM_NTASKS and SLURM_NODELIST not: launch each rank with srun inside an "
        "allocation (sbatch or salloc), or unset SLURM_PROCID for a single process"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        single = subprocess.run([*base, "train.max_steps=1", "train.eval_every=0", "checkpoint.save=false",
                                 "logging.progress=false", f"logging.run_dir={tmp_path / 'single'}"], cwd=ROOT,
                                capture_output=True, text=True, timeout=300, env={**clean, "MASTER_PORT": str(port)})
        assert single.returncode == 0, single.stderr[-2000:]
        out = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**clean, "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"error: the master port {port} on 127.0.0.1 is already in use (another run on this machine?): set "
        "MASTER_PORT to a free port"]
    assert not (tmp_path / "run").exists()


def test_device_is_cpu_without_cuda():
    assert platform.device().type == ("cuda" if torch.cuda.is_available() else "cpu")


# An optimizer steps, saves, and loads into a fresh one, which steps again. Each patch of a
# megatron optimizer method is undone in turn (through its __wrapped__) and the run must then fail.
OPTIMIZER_RESUME = """
import sys, torch
from megatron_rl import platform
from megatron_rl.config import Config
from megatron_rl import checkpointing
from megatron_rl.training.setup import build_trainee
from megatron_rl.training.step import optimizer_step, zero_grads
import megatron.core.optimizer as megatron_optimizer

def step(trainee):
    zero_grads(trainee)
    for p in trainee.model[0].parameters():
        p.main_grad.fill_(0.01)
    optimizer_step(trainee)

if __name__ == "__main__":
    run_dir, precision, distributed, *undo = sys.argv[1:]
    for spec in undo:  # "Class.method"
        cls_name, attr = spec.split(".")
        cls = getattr(megatron_optimizer, cls_name)
        setattr(cls, attr, getattr(cls, attr).__wrapped__)
    platform.init_distributed()
    platform.init_model_parallel()
    cfg = Config()
    cfg.model.vocab_size = 16
    cfg.train.precision = precision
    cfg.optimizer.distributed = distributed == "distributed"
    first = build_trainee(cfg)
    step(first)
    path = checkpointing.save(first, run_dir, 1, {})
    second = build_trainee(cfg)
    checkpointing.load(second, path)
    step(second)
    steps = {float(s["step"]) for s in second.optimizer.chained_optimizers[0].optimizer.state.values()}
    assert steps == {2.0}, f"Adam step counts after resume + 1 step: {steps}"
"""

# name -> (precision, optimizer, the patched method)
OPTIMIZER_PATCHES = {
    "fix: fully_reshardable load keeps torch Adam's step":
        ("fp32", "distributed", "DistributedOptimizer._set_main_param_and_optimizer_states"),
    "fix: each parameter owns its Adam step after loading":
        ("fp32", "distributed", "DistributedOptimizer.load_state_dict"),
    "cpu: bf16 optimizer sorts parameters by type() name":
        ("bf16", "plain", "Float16OptimizerWithFloat16Params.__init__"),
    "cpu: distributed optimizer sorts parameters by type() name":
        ("bf16", "distributed", "DistributedOptimizer.__init__"),
}


def _run_script(text: str, tmp_path, *args) -> subprocess.CompletedProcess:
    """Run `text` as a script (one process) with `args`."""
    script = tmp_path / "script.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)


def _resume_optimizer(tmp_path, precision, optimizer, *undo) -> subprocess.CompletedProcess:
    return _run_script(OPTIMIZER_RESUME, tmp_path, tmp_path / "run", precision, optimizer, *undo)


@pytest.mark.parametrize("precision, optimizer", [("fp32", "distributed"), ("bf16", "plain"),
                                                  ("bf16", "distributed")])
def test_optimizer_resumes_with_patches(precision, optimizer, tmp_path):
    proc = _resume_optimizer(tmp_path, precision, optimizer)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("name", list(OPTIMIZER_PATCHES))
def test_optimizer_patch_is_needed(name, tmp_path):
    if name.startswith("cpu:") and torch.cuda.is_available():
        pytest.skip("the CPU patches apply only without CUDA")
    without = _resume_optimizer(tmp_path, *OPTIMIZER_PATCHES[name])
    assert without.returncode != 0, f"{name}: ran without the patch; is it still needed?"


# A tiny MLA + MoE model (DeepSeek-shaped) builds and runs forward; each fix of megatron-core's
# TE-less paths is undone in turn and the run must then fail.
MLA_MOE_FORWARD = """
import sys, torch
from megatron_rl import platform
from megatron_rl.config import Config, ModelConfig
from megatron_rl.training.setup import build_model
import megatron.core.transformer.multi_latent_attention as mla
import megatron.core.transformer.moe.moe_utils as moe_utils

if __name__ == "__main__":
    if "mla" in sys.argv:
        mla.HAVE_TE = True  # what megatron-core itself concludes without TE
    if "router" in sys.argv:
        del moe_utils.te_general_gemm
    platform.init_distributed()
    platform.init_model_parallel()
    model = ModelConfig(family="deepseek", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
                        vocab_size=16, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=16,
                        kv_lora_rank=8, qk_head_dim=8, qk_pos_head_dim=4, v_head_dim=8, num_experts=4,
                        moe_ffn_hidden_size=16, moe_topk=2, moe_score_function="sigmoid", moe_expert_bias=True)
    chunks, _ = build_model(Config(model=model), wrap_ddp=False)
    tokens = torch.randint(0, 16, (1, 8))
    print(chunks[0](tokens, torch.arange(8)[None], None).shape)
"""


@pytest.mark.parametrize("fix", ["mla", "router"])
def test_te_less_fix_is_needed(fix, tmp_path):
    assert _run_script(MLA_MOE_FORWARD, tmp_path, fix).returncode != 0, f"the {fix} fix is not needed any more"
    proc = _run_script(MLA_MOE_FORWARD, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


# megatron-core's dynamic inference engine generates on CPU without flash-attn; each patch it
# needs is undone in turn and generation must then fail. (The inference send/recv patch for
# pipeline parallelism is exercised by tests/test_grpo.py's PP=2 run.)
DYNAMIC_ENGINE = """
import sys, torch
from megatron_rl import platform
from megatron_rl.config import Config
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.training.setup import build_model
import megatron.core.inference.engines.dynamic_engine as dynamic_engine
import megatron.core.transformer.attention as attention

if __name__ == "__main__":
    if "nvtx" in sys.argv:
        dynamic_engine.range_push = torch.cuda.nvtx.range_push
    if "flash_attn" in sys.argv:
        attention.flash_attn_with_kvcache = attention.flash_attn_varlen_func = None
    platform.init_distributed()
    platform.init_model_parallel()
    tok = build_char_tokenizer("0123456789", sys.argv[1])
    cfg = Config()
    cfg.model.vocab_size = len(tok)
    chunks, _ = build_model(cfg, wrap_ddp=False)
    print(RolloutEngine(chunks, cfg.model, tok, cfg.rollout, torch.float32).generate([[1, 4, 5]], n=2).completions)
"""


@pytest.mark.parametrize("patch", ["nvtx", "flash_attn"])
def test_dynamic_engine_patch_is_needed(patch, tmp_path):
    if patch == "nvtx" and torch.cuda.is_available():
        pytest.skip("the nvtx patch applies only without CUDA")
    tok = tmp_path / "tok"
    assert _run_script(DYNAMIC_ENGINE, tmp_path, tok, patch).returncode != 0, f"the {patch} patch is not needed any more"
    proc = _run_script(DYNAMIC_ENGINE, tmp_path, tok)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available() or not platform.cpu.has_onednn_linear(),
                    reason="the oneDNN GEMM patch applies only on CPU with oneDNN")
def test_linear_rows_do_not_depend_on_the_row_count(monkeypatch):
    """A decode step feeds megatron's linear layers a few rows where training feeds thousands; the
    rollout logprobs equal the training ones only if each row comes out the same either way. The
    patched forward GEMM (oneDNN) does that; megatron's torch.matmul (MKL's sgemm) does not."""
    from megatron.core.tensor_parallel import layers

    torch.manual_seed(0)
    x, w = torch.randn(256, 1, 96, requires_grad=True), torch.randn(160, 96, requires_grad=True)

    def forward(rows):
        return layers.LinearWithGradAccumulationAndAsyncCommunication.apply(x[:rows], w, None, False, False, False,
                                                                            None, 0, None)

    def row_count_changes_rows():
        full = forward(len(x))
        return [rows for rows in (2, 3, 5, 8, 64) if not torch.equal(forward(rows), full[:rows])]

    full = forward(len(x))
    torch.testing.assert_close(full, x @ w.t())
    full.square().sum().backward()  # the backward is megatron's own
    torch.testing.assert_close(w.grad, 2 * (x @ w.t()).flatten(0, 1).t() @ x.flatten(0, 1))
    assert row_count_changes_rows() == []
    monkeypatch.setattr(layers, "torch", platform.cpu.CPU_TORCH)  # megatron's GEMM as it comes
    assert row_count_changes_rows() != [], "MKL gives each row the same result now; is the patch still needed?"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the inference fast path is a CPU patch")
def test_inference_skips_the_autograd_functions(one_process, monkeypatch):
    """Under torch.inference_mode (rollouts) megatron's linear layers and the tensor-parallel copy and
    reduce run their forward arithmetic without torch.autograd.Function's dispatch: no Function is
    applied, and the outputs equal the training-mode forward's bit for bit."""
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    init = torch.nn.init.normal_
    column = layers.ColumnParallelLinear(32, 48, config=config, init_method=init, bias=True, gather_output=False)
    row = layers.RowParallelLinear(48, 32, config=config, init_method=init, bias=False, input_is_parallel=True,
                                   skip_bias_add=False)
    x = torch.randn(8, 2, 32)

    def forward():
        return row(column(x)[0])[0]

    applied = []
    for cls in (layers.LinearWithGradAccumulationAndAsyncCommunication, mappings._CopyToModelParallelRegion,
                mappings._ReduceFromModelParallelRegion):
        monkeypatch.setattr(cls, "apply", (lambda apply, name: classmethod(
            lambda c, *a: (applied.append(name), apply(*a))[1]))(cls.apply, cls.__name__))
    training = forward()
    assert len(applied) == 4  # copy, column linear, row linear, reduce
    applied.clear()
    with torch.inference_mode():
        assert torch.equal(forward(), training.detach()) and applied == []
    names = ("linear_with_grad_accumulation_and_async_allreduce", "copy_to_tensor_model_parallel_region",
             "reduce_from_tensor_model_parallel_region")
    for name in names:  # megatron's functions as they come
        monkeypatch.setattr(layers, name, getattr(layers, name).__wrapped__)
    with torch.inference_mode():
        forward()
    assert len(applied) == 4, "megatron skips the Functions in inference mode itself now: is the patch still needed?"


def test_only_known_warnings_are_silenced():
    """megatron-core's "not installed, falling back" messages are filtered (platform/__init__.py);
    an unrelated warning still prints."""
    code = ("import warnings; from megatron_rl import platform; import megatron.core.optimizer, "
            "megatron.core.models.gpt.gpt_layer_specs; warnings.warn('something unrelated')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "UserWarning: something unrelated" in out.stderr
    assert "not installed" not in out.stderr, out.stderr


@pytest.mark.parametrize("capability,tp,cp,env,warns", [
    (9, 2, 1, {}, True), (8, 1, 2, {}, True), (9, 2, 1, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, False),
    (10, 2, 1, {}, False), (9, 1, 1, {}, False)])
def test_cuda_connections_warning(monkeypatch, capability, tp, cp, env, warns):
    """Warned on Ampere/Hopper with TP or CP > 1 unless set to 1; never on Blackwell or without TP/CP."""
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (capability, 0))
    assert bool(platform.check_cuda_connections(tp, cp, env=env)) == warns


# megatron-core's hybrid model on a machine without mamba_ssm, causal_conv1d, Triton and Transformer
# Engine: each fix (the torch kernels for the Mamba mixer, our tensor helpers in place of the Triton
# module it imports, our norm for MambaStack's TE-only final norm) is undone in turn and building or
# running the model must then fail.
HYBRID = """
import sys, torch
from megatron_rl import platform
from megatron_rl.platform import fixes, hooks

if __name__ == "__main__":
    if "kernels" in sys.argv:
        hooks._BY_NAME["megatron.core.ssm.mamba_mixer"].remove(fixes._mamba_without_kernels)
    if "triton" in sys.argv:
        hooks._SUBSTITUTES.clear()
    if "final_norm" in sys.argv:
        hooks._BY_NAME["megatron.core.ssm.mamba_block"].remove(fixes._mamba_stack_final_norm)
    from megatron_rl.config import Config
    from megatron_rl.training.setup import build_model
    from recipes.tiny import tiny_nemotron_h_model

    platform.init_distributed()
    platform.init_model_parallel()
    model = tiny_nemotron_h_model()
    model.vocab_size = 16
    chunks, _ = build_model(Config(model=model), wrap_ddp=False)
    print(chunks[0](torch.randint(0, 16, (1, 8)), torch.arange(8)[None], None).shape)
"""


def test_hybrid_fixes_are_needed(tmp_path):
    import importlib.util

    needs = {"kernels": "mamba_ssm", "triton": "triton", "final_norm": "transformer_engine"}
    for fix, package in needs.items():
        if importlib.util.find_spec(package) is None:
            assert _run_script(HYBRID, tmp_path, fix).returncode != 0, f"the {fix} fix is not needed any more"
    proc = _run_script(HYBRID, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available() or not platform.cpu.has_onednn_linear(),
                    reason="the oneDNN GEMM patch applies only on CPU with oneDNN")
def test_linear_backward_runs_on_onednn(one_process, monkeypatch):
    """Training's linear layers compute their input and weight gradients with oneDNN (MKL's sgemm,
    which megatron's backward calls, takes about twice as long here), and they equal the exact ones;
    a layer that got no rows (an MoE expert without tokens) gets a zero weight gradient."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    column = layers.ColumnParallelLinear(64, 96, config=config, init_method=torch.nn.init.normal_, bias=True,
                                         gather_output=False)
    x = torch.randn(40, 2, 64, dtype=torch.float64).float().requires_grad_()
    calls, plain = [], platform.cpu.onednn_linear
    monkeypatch.setattr(platform.cpu, "onednn_linear", lambda a, w: (calls.append(a.shape), plain(a, w))[1])
    out = column(x)[0]
    (out * torch.linspace(-1, 1, 96)).sum().backward()
    assert len(calls) == 3  # forward, input gradient, weight gradient
    w, b = column.weight.detach().double(), column.bias.detach().double()
    xd = x.detach().double().requires_grad_()
    wd, bd = w.clone().requires_grad_(), b.clone().requires_grad_()
    ((xd @ wd.t() + bd) * torch.linspace(-1, 1, 96, dtype=torch.float64)).sum().backward()
    for got, want in ((x.grad, xd.grad), (column.weight.grad, wd.grad), (column.bias.grad, bd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    column.weight.grad = None
    column(torch.zeros(0, 1, 64, requires_grad=True))[0].sum().backward()  # an expert that got no tokens
    assert torch.equal(column.weight.grad, torch.zeros_like(column.weight))


@pytest.mark.skipif(torch.cuda.is_available() or not platform.cpu.has_onednn_linear(),
                    reason="the oneDNN GEMM patch applies only on CPU with oneDNN")
def test_packed_weights_give_the_plain_products(one_process):
    """Within packed_weights() (a rollout; a step's forward and backward) the linear layers' forward
    and input-gradient GEMMs take each weight in oneDNN's blocked layout, reordered once (one per
    parameter and orientation) and dropped on exit; outputs and gradients equal the plain weight's to
    the bit, in training and in inference mode. A single row keeps the plain weight: with 3 outputs
    oneDNN rounds it otherwise from the blocked layout."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import TransformerConfig

    cpu = platform.cpu
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    for features in (3, 96, 1000):
        column = layers.ColumnParallelLinear(64, features, config=config, init_method=torch.nn.init.normal_,
                                             bias=False, gather_output=False)
        for rows in (1, 2, 3, 5, 8, 64, 300):
            x = torch.randn(rows, 1, 64)
            seen = {}
            for packed in (False, True):
                with cpu.packed_weights() if packed else contextlib.nullcontext():
                    xg = x.clone().requires_grad_()
                    out = column(xg)[0]
                    (out * torch.linspace(-1, 1, features)).sum().backward()
                    with torch.inference_mode():
                        inference = column(x)[0]
                    if packed:
                        assert len(cpu._packs) == (2 if rows > 1 else 0), (features, rows, list(cpu._packs))
                seen[packed] = (out.detach(), xg.grad, column.weight.grad.clone(), inference)
                column.weight.grad = None
            assert cpu._packs is None
            for plain, blocked in zip(seen[False], seen[True]):
                assert torch.equal(plain, blocked), (features, rows)


FREED_MEMORY = """
import resource, sys, torch
from megatron_rl import platform
if sys.argv[1] == "keep":
    platform.keep_freed_memory()
torch.empty(16 << 20).fill_(1.0)  # 64 MB, freed at once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(12 << 20).fill_(1.0)  # 48 MB
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or torch.cuda.is_available(), reason="glibc, CPU runs")
def test_freed_memory_stays_with_the_process(tmp_path):
    """Without keep_freed_memory glibc maps each large block afresh and the kernel faults its pages in
    again (12k for 48 MB); with it a 48 MB block reuses the pages of a freed 64 MB one."""
    faults = {}
    for mode in ("keep", "plain"):
        out = _run_script(FREED_MEMORY, tmp_path, mode)
        assert out.returncode == 0, out.stderr[-2000:]
        faults[mode] = int(out.stdout.split()[-1])
    assert faults["plain"] > 10_000 and faults["keep"] < 1_000, faults


ADAM_STATE = """
import torch
from megatron_rl import platform
from megatron_rl.config import Config
import megatron_rl.training.setup as setup
from megatron_rl.training.step import optimizer_step, zero_grads

def inner(trainee):
    return [c.optimizer for c in trainee.optimizer.chained_optimizers]

def run(lazy):
    platform.init_model_parallel(seed=7)
    cfg = Config()
    cfg.model.vocab_size = 16
    plain = setup.allocate_state
    if lazy:
        setup.allocate_state = lambda optimizer: None
    trainee = setup.build_trainee(cfg)
    setup.allocate_state = plain
    made = all(len(o.state[p]) == 3 for o in inner(trainee) for g in o.param_groups for p in g["params"])
    for k in range(2):
        zero_grads(trainee)
        for i, p in enumerate(trainee.model[0].parameters()):
            p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * i + k)))
        optimizer_step(trainee)
    return made, [p.detach().clone() for p in trainee.model[0].parameters()], inner(trainee)[0].state

platform.init_distributed()
made, early, state = run(lazy=False)
assert made, "Adam's state is not made when the optimizer is built"
made, lazy, lazy_state = run(lazy=True)
assert not made
assert all(torch.equal(a, b) for a, b in zip(early, lazy)), "the state made at setup changed the steps"
assert [sorted(s) for s in state.values()] == [sorted(s) for s in lazy_state.values()]
print("ok")
"""


def test_adam_state_is_made_at_setup_and_steps_as_torchs_own(tmp_path):
    """allocate_state makes what torch's Adam makes at its first step: two steps then give the
    same parameters, bit for bit, as with torch's lazy state."""
    out = _run_script(ADAM_STATE, tmp_path)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# A garbage cycle the parent has not collected when reward workers fork; each worker collects. Its
# finalizer records the process that ran it: the parent only (the platform freezes the heap across each
# fork). Undone in the child ("undo": gc.unfreeze after the fork), every worker finalizes it again.
FORK_GC = """
import gc, os, sys
import megatron_rl.platform
from megatron_rl.environments import EnvRunner, Environment, Turn

if sys.argv[2] == "undo":
    os.register_at_fork(after_in_child=gc.unfreeze)

class Cycle:
    def __del__(self):
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()}\\n")

class Collecting(Environment):
    def __init__(self, cfg=None):
        pass

    def step_one(self, conversation, metadata):
        gc.collect()
        return Turn(reward=1.0)

gc.disable()
cycle = Cycle()
cycle.me = cycle
del cycle
runner = EnvRunner(Collecting(), timeout=10, workers=2)
assert [t.reward for t in runner.step([[{"role": "user", "content": "p"}]] * 4, [{}] * 4).turns] == [1.0] * 4
runner.close()
gc.enable()
gc.collect()
print(os.getpid(), open(sys.argv[1]).read().split())
"""


@pytest.mark.parametrize("undo", [False, True], ids=["frozen", "undone"])
def test_forked_workers_never_collect_what_they_inherited(undo, tmp_path):
    """After many runs in one process, reward workers segfaulted in the garbage collector (finalizing
    the parent's objects) and the run waited out every job's timeout (test_readme.py, 1 run in 6)."""
    out = _run_script(FORK_GC, tmp_path, tmp_path / "finalized", "undo" if undo else "fix")
    assert out.returncode == 0, out.stderr[-3000:]
    parent, finalized = out.stdout.split(" ", 1)
    assert (eval(finalized) == [parent]) != undo, out.stdout
