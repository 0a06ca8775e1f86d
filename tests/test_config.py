import json

import pytest

from megatron_rl.config import ConfigError, apply_overrides
from recipes import get_recipe, list_recipes
from tests.helpers import run_train


def test_overrides_are_typed():
    cfg = apply_overrides(get_recipe("tiny_sft"), ["optimizer.lr=3e-4", "train.max_steps=50",
                                                   "optimizer.distributed=true", "scheduler.decay=linear"])
    assert cfg.optimizer.lr == 3e-4 and cfg.train.max_steps == 50
    assert cfg.optimizer.distributed is True and cfg.scheduler.decay == "linear"


@pytest.mark.parametrize("override, message", [
    ("optimizer.lrr=1", "unknown config key 'optimizer.lrr'. Did you mean optimizer.lr"),
    ("train.max_steps=abc", "train.max_steps='abc' is not an integer"),
    ("optimizer.distributed=maybe", "is not a boolean"),
    ("scheduler.decay=cubic", "is not one of 'cosine', 'linear', 'constant'"),
    ("optimizer", "is not of the form section.field=value"),
    ("train.fp8=hybrid", "train.fp8 is gone: FP8 has its own section now; use fp8.format (with fp8.recipe"),
    ("fp8.recipe=nvfp4", "fp8.recipe='nvfp4' is not one of 'tensorwise', 'delayed', 'blockwise', 'mxfp8'"),
    ("profiling.ranks=0,x", "profiling.ranks='x' is not an integer"),
])
def test_bad_override_messages(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        apply_overrides(get_recipe("tiny_sft"), [override])


def test_unknown_recipe():
    with pytest.raises(ConfigError, match="unknown recipe 'tiny_stf'. Did you mean tiny_sft"):
        get_recipe("tiny_stf")
    assert "tiny_sft" in list_recipes()


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.tp=3"], 3, "model.num_attention_heads=4 is not divisible by parallel.tp=3"),
    (["parallel.tp=2"], 3, "world size 3 is not divisible by tp x pp x cp"),
    (["parallel.pp=4"], 4, "model.num_layers=2 is not divisible by parallel.pp x parallel.vpp"),
    (["parallel.dp=4"], 2, "parallel.dp=4 but world size 2"),
    (["parallel.sp=true"], 1, "parallel.sp=true needs parallel.tp > 1"),
    (["data.global_batch_size=48"], 2, "data.global_batch_size=48 is not divisible"),
    (["parallel.cp=2", "data.seq_length=18"], 2, "data.seq_length=18 must be divisible by 4"),
    (["parallel.tp=2", "parallel.sp=true", "data.seq_length=15"], 2, "data.seq_length=15 must be divisible by 2"),
])
def test_invalid_layouts(overrides, world, message):
    cfg = apply_overrides(get_recipe("tiny_sft"), overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cfg.validate(world_size=world)


def test_cli_errors_are_one_line():
    proc = run_train(["--recipe", "nope"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown recipe 'nope'")
    proc = run_train(["--recipe", "tiny_sft", "optimizer.lrr=1"], check=False)
    assert proc.returncode == 2 and "Did you mean optimizer.lr" in proc.stderr
    if not __import__("torch").cuda.is_available():  # FP8 without Transformer Engine and a GPU
        proc = run_train(["--recipe", "tiny_sft", "fp8.format=hybrid"], check=False)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            'error: fp8.format=hybrid needs Transformer Engine and a GPU: pip install -e ".[gpu]" on a CUDA machine (or '
            'use the container), or set fp8.format=off.']


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.state_dtype=bf16"], "optimizer.state_dtype=bf16 works on megatron-core's distributed Adam: set "
                                     "optimizer.distributed=true (and optimizer.name=adam)."),
    (["optimizer.cpu_offload=0.5", "optimizer.distributed=true", "train.precision=fp32"],
     "optimizer.cpu_offload is for bf16 training (train.precision=bf16 or auto on a GPU); with train.precision=fp32 "
     "keep optimizer.state_dtype=fp32 and optimizer.cpu_offload=0."),
    (["optimizer.cpu_offload=1.5"], "optimizer.cpu_offload=1.5 is the share of the optimizer state moved to host "
                                    "memory: give a number in [0, 1]."),
    (["optimizer.cpu_offload=1", "optimizer.state_dtype=bf16", "optimizer.distributed=true"],
     "optimizer.state_dtype=bf16 and optimizer.cpu_offload do not combine (megatron-core's offloaded optimizer keeps "
     "fp32 state): choose one."),
    (["optimizer.name=muon", "optimizer.muon_momentum=1"], "optimizer.muon_momentum=1.0 is out of range: give a number "
                                                           "in [0, 1) (0.95 is usual)."),
    (["optimizer.name=muon", "optimizer.muon_ns_steps=0"], "optimizer.muon_ns_steps=0 is out of range: give 1 to 99 "
                                                           "Newton-Schulz iterations (5 is usual)."),
    (["optimizer.name=muon", "optimizer.muon_ns_coefficients=3.4,-4.7"],
     "optimizer.muon_ns_coefficients has 2 numbers; the quintic iteration takes three, a,b,c (default "
     "3.4445,-4.775,2.0315)."),
    (["optimizer.name=muon", "optimizer.state_dtype=bf16", "optimizer.distributed=true"],
     "optimizer.state_dtype=bf16 is Adam's (megatron-core's precision-aware optimizer): Muon keeps one fp32 momentum "
     "per matrix on the device; with optimizer.name=muon drop it."),
    (["optimizer.name=muon", "optimizer.cpu_offload=1", "optimizer.distributed=true"],
     "optimizer.cpu_offload is Adam's (megatron-core's precision-aware optimizer): Muon keeps one fp32 momentum per "
     "matrix on the device; with optimizer.name=muon drop it."),
])
def test_optimizer_memory_settings_refused(overrides, message):
    cfg = apply_overrides(get_recipe("tiny_sft"), overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert str(e.value) == message


def test_optimizer_memory_settings_map_to_megatron(monkeypatch):
    """bf16 moments and CPU offload become megatron-core's own OptimizerConfig fields (its offload runs
    on the precision-aware optimizer's code path); megatron accepts the offload settings as given
    (its version check of Transformer Engine stubbed where TE is absent)."""
    import dataclasses
    import importlib.util

    import megatron.core.optimizer.optimizer_config as megatron_optimizer_config

    import torch
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    from megatron_rl.training.setup import _optimizer_memory_kwargs

    cfg = apply_overrides(get_recipe("tiny_sft"), ["optimizer.distributed=true", "train.precision=bf16"])
    assert _optimizer_memory_kwargs(cfg.optimizer) == {}
    cfg.optimizer.state_dtype = "bf16"
    bf16 = _optimizer_memory_kwargs(cfg.optimizer)
    assert bf16["use_precision_aware_optimizer"] and bf16["exp_avg_dtype"] == bf16["exp_avg_sq_dtype"] == torch.bfloat16
    assert not bf16["optimizer_cpu_offload"]
    cfg.optimizer.state_dtype, cfg.optimizer.cpu_offload = "fp32", 0.25
    offload = _optimizer_memory_kwargs(cfg.optimizer)
    assert set(bf16) | set(offload) <= {f.name for f in dataclasses.fields(MegatronOptimizerConfig)}
    if importlib.util.find_spec("transformer_engine") is None:
        monkeypatch.setattr(megatron_optimizer_config, "is_te_min_version", lambda version: True)
    built = MegatronOptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True, **offload)
    assert built.optimizer_cpu_offload and built.optimizer_offload_fraction == 0.25
    assert built.exp_avg_dtype == torch.float32 and built.use_precision_aware_optimizer_no_fp8_or_ds_fp8


def test_optimizer_memory_settings_need_a_gpu(tmp_path):
    """On a machine without CUDA: one sentence, exit 2, no run directory."""
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    run_dir = tmp_path / "run"
    proc = run_train(["--recipe", "tiny_sft", "optimizer.distributed=true", "train.precision=bf16",
                      "optimizer.state_dtype=bf16", f"logging.run_dir={run_dir}"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: optimizer.state_dtype=bf16 needs a GPU (megatron-core keeps the optimizer state in GPU memory, which it "
        "shrinks or moves to the host); on the CPU the state is in host memory already: set optimizer.state_dtype=fp32 "
        "and optimizer.cpu_offload=0."]
    assert not run_dir.exists()


def test_fp8_settings(monkeypatch):
    """Refused when the config is read: delayed scaling with bf16 first/last layers (megatron-core
    raises later); and a recipe TE's own probe says this machine cannot run (TE stubbed on CPU)."""
    import sys
    import types

    from megatron_rl.platform.support import check_fp8
    from model_providers.builder import _fp8_kwargs

    cfg = apply_overrides(get_recipe("tiny_sft"), ["fp8.format=hybrid", "fp8.recipe=delayed", "fp8.bf16_first_layers=1"])
    with pytest.raises(ConfigError, match="fp8.recipe=delayed cannot keep the first or last layers in bf16"):
        cfg.validate()
    cfg.fp8.recipe = "blockwise"
    cfg.validate()
    from megatron.core.transformer import TransformerConfig

    assert set(_fp8_kwargs(cfg.fp8)) <= set(TransformerConfig.__dataclass_fields__)
    assert _fp8_kwargs(cfg.fp8)["first_last_layers_bf16"] is True

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.fp8 = probes = types.ModuleType("transformer_engine.pytorch.fp8")
    probes.check_fp8_support = lambda: (True, "")
    probes.check_fp8_block_scaling_support = lambda: (True, "")
    probes.check_mxfp8_support = lambda: (False, "Device compute capability 10.0 or higher required for MXFP8 execution.")
    for name, module in (("transformer_engine", te), ("transformer_engine.pytorch", te.pytorch),
                         ("transformer_engine.pytorch.fp8", probes)):
        monkeypatch.setitem(sys.modules, name, module)
    check_fp8(cfg.fp8)  # blockwise: supported here
    cfg.fp8.recipe = "mxfp8"
    with pytest.raises(ConfigError) as e:
        check_fp8(cfg.fp8)
    assert str(e.value) == ("fp8.recipe=mxfp8 cannot run on this machine (Device compute capability 10.0 or higher "
                            "required for MXFP8 execution): use fp8.recipe=tensorwise or blockwise.")


def test_missing_checkpoint_is_one_line(tmp_path):
    missing = tmp_path / "checkpoints" / "step_0000009"
    proc = run_train(["--recipe", "tiny_sft", f"checkpoint.load={missing}", f"logging.run_dir={tmp_path / 'run'}"],
                     check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: checkpoint '{missing}' does not exist."


def test_cli_print_config_and_list():
    proc = run_train(["--recipe", "tiny_sft", "optimizer.lr=3e-4", "train.max_steps=50", "--print-config"])
    assert '"lr": 0.0003' in proc.stdout and '"max_steps": 50' in proc.stdout
    assert "  tiny_sft " in run_train(["--list-recipes"]).stdout


def test_every_recipe_prints_from_one_process(monkeypatch, capsys, tmp_path):
    """--print-config of a cluster recipe on a laptop: checked against the recipe's own layout, not the
    one process it was started as (nemotron_grpo at tp=2 was refused); a recipe for any HF model with one."""
    import train
    from recipes import recipes_by_family
    from tests.hf_models import save_tiny_model

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    hf = save_tiny_model("llama", tmp_path / "llama")
    for name in (n for recipes in recipes_by_family().values() for n in recipes):
        model = [f"model.hf_path={hf}"] if name.startswith("hf_") else []
        assert train.main(["--recipe", name, "--print-config", *model]) == 0, (name, capsys.readouterr().err)
        assert json.loads(capsys.readouterr().out)["recipe"] == name


def test_dict_overrides_take_numbers_or_text():
    from megatron_rl.config import ConfigError, apply_overrides
    from recipes import get_recipe

    cfg = apply_overrides(get_recipe("tiny_mopd"), ["distill.teachers=add:runs/a, sub:/abs/b", "rewards.weights=x:1,y:0.5"])
    assert cfg.distill.teachers == {"add": "runs/a", "sub": "/abs/b"} and cfg.rewards.weights == {"x": 1.0, "y": 0.5}
    with pytest.raises(ConfigError, match="write name:value pairs"):
        apply_overrides(get_recipe("tiny_mopd"), ["distill.teachers=add"])
    with pytest.raises(ConfigError, match="needs a teacher"):
        apply_overrides(get_recipe("tiny_mopd"), ["distill.teacher=x"]).validate()
