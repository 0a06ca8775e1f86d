"""HF <-> megatron conversion for every family: logits parity with transformers, bit-exact round
trips, greedy generation, other layouts under torchrun, the CLI, training from HF, bad input."""

import json
import shutil
import sys

import pytest
import torch

from megatron_rl.config import Config, ConfigError
from tests.helpers import ROOT, launch_env, run_train, torchrun
from tests.hf_models import FAMILIES, VOCAB, hf_logits, save_tiny_model

pytestmark = pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")

TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
LOGIT_TOL = 1e-4  # fp32, max abs difference


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_tiny_model(name, root / name, seed=i) for i, name in enumerate(FAMILIES)}


def megatron_model(path):
    from megatron_rl.hf import import_hf, model_config_from_hf
    from megatron_rl.training.setup import build_model

    cfg = Config(model=model_config_from_hf(path))
    chunks, _ = build_model(cfg, wrap_ddp=False)
    import_hf(chunks, cfg.model, path)
    chunks[0].eval()
    return chunks, cfg.model


def megatron_logits(chunk, tokens):
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return chunk(tokens, positions, None)[..., :VOCAB]


def safetensors_of(path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def assert_bit_exact(original, exported):
    a, b = safetensors_of(original), safetensors_of(exported)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, models, one_process):
    chunks, _ = megatron_model(models[family])
    ref = hf_logits(models[family], TOKENS)
    assert ref.abs().max() > 2.0  # logits far from uniform: a wrong mapping would show
    assert (megatron_logits(chunks[0], TOKENS) - ref).abs().max() <= LOGIT_TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bit_exact(family, models, one_process, tmp_path):
    from megatron_rl.hf import export_hf, write_assets

    chunks, model = megatron_model(models[family])
    write_assets(models[family], tmp_path / "assets")
    export_hf(chunks, model, tmp_path / "hf", assets=tmp_path / "assets")
    assert_bit_exact(models[family], tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(safetensors_of(models[family]))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3", "nemotron", "nemotron_h"])
def test_greedy_generation_matches_transformers(family, models, one_process, tmp_path):
    """Greedy decoding of the Megatron model (a plain loop, full forward per token) equals
    transformers' generate on the exported model."""
    import transformers

    from megatron_rl.hf import export_hf, write_assets

    chunks, model = megatron_model(models[family])
    write_assets(models[family], tmp_path / "assets")
    export_hf(chunks, model, tmp_path / "hf", assets=tmp_path / "assets")
    tokens = TOKENS[:1, :5]
    for _ in range(10):
        nxt = megatron_logits(chunks[0], tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    expected = hf.generate(TOKENS[:1, :5], max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert tokens.tolist() == expected.tolist()
    assert len(set(tokens[0, 5:].tolist())) > 2  # it generates something, not one token repeated


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn", "nemotron", "nemotron_h"])
def test_rollout_engine_matches_full_forward(family, models, one_process):
    """megatron-core's dynamic engine (paged KV cache, platform/paged_attention.py without
    flash-attn) on the imported model: its greedy tokens are the full forward's argmax, and its
    logprobs the full forward's log-softmax (GQA, MoE, partial rotary, Mamba states, and multi-latent
    attention from its latent cache, with and without query compression and YaRN)."""
    from transformers import AutoTokenizer

    from megatron_rl.config import RolloutConfig
    from megatron_rl.rollout.engine import RolloutEngine

    chunks, model = megatron_model(models[family])
    rollout = RolloutConfig(max_new_tokens=10, max_sequence_length=32, max_requests=4, kv_cache_gb=0.01,
                            block_size_tokens=64 if model.multi_latent_attention else 32)
    tokenizer = AutoTokenizer.from_pretrained(str(models[family]))
    engine = RolloutEngine(chunks, model, tokenizer, rollout, torch.float32, stop_at_eos=False)
    prompts = [TOKENS[0, :5].tolist(), TOKENS[1, :9].tolist()]
    out = engine.generate(prompts, greedy=True)
    chunks[0].eval()
    for prompt, completion, logprobs in zip(prompts, out.completions, out.logprobs):
        assert len(completion) == 10
        logits = megatron_logits(chunks[0], torch.tensor([prompt + completion]))[0, len(prompt) - 1:-1]
        assert completion == logits.argmax(-1).tolist()
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert (torch.tensor(logprobs) - expected).abs().max() <= 1e-5


def test_transformers_5_fused_experts_import(one_process, tmp_path):
    """MoE checkpoints in transformers 5's fused in-memory layout (experts.gate_up_proj) import too."""
    path = save_tiny_model("qwen3_moe", tmp_path / "fused", seed=3, fused=True)
    assert any(k.endswith("experts.gate_up_proj") for k in safetensors_of(path))
    chunks, _ = megatron_model(path)
    assert (megatron_logits(chunks[0], TOKENS) - hf_logits(path, TOKENS)).abs().max() <= LOGIT_TOL


LAYOUTS = {
    "tp2": (["--tp", "2"], ["llama", "mistral", "qwen2", "qwen3", "nemotron"]),
    "tp2-sp-moe": (["--tp", "2", "--sp"], ["deepseek_v3", "qwen3_moe", "nemotron_h"]),
    "pp2": (["--pp", "2"], ["mistral", "qwen2", "nemotron", "qwen3_moe", "nemotron_h"]),
    "ep2": (["--ep", "2"], ["qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3_yarn", "nemotron_h"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_other_layouts(layout, models, tmp_path):
    """Import sharded at TP2 / PP2 / EP2 (torchrun, gloo): the same logits; export gathers back to
    the original tensors bit for bit (through many small shards)."""
    import subprocess

    flags, families = LAYOUTS[layout]
    cmd = [*torchrun(2), "tests/scripts/hf_layout.py", str(tmp_path), *flags, *(f"{f}={models[f]}" for f in families)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for family in families:
        got = torch.load(tmp_path / f"{family}_logits.pt")
        assert (got - hf_logits(models[family], TOKENS)).abs().max() <= LOGIT_TOL, family
        assert_bit_exact(models[family], tmp_path / f"{family}_hf")
    assert len(list((tmp_path / f"{families[0]}_hf").glob("model-*.safetensors"))) > 1


def test_cli_round_trip_in_bf16(tmp_path):
    """The CLI: a bf16 checkpoint imports and exports bit-exactly, loads with Auto* classes, and
    an existing output is refused unless --overwrite."""
    import subprocess

    import transformers

    src = save_tiny_model("qwen3", tmp_path / "src", seed=7, dtype=torch.bfloat16)

    def convert(*args):
        return subprocess.run([sys.executable, "tools/convert_checkpoint.py", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env=launch_env())

    proc = convert("import", "--hf", str(src), "--out", str(tmp_path / "mg"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = convert("export", "--megatron", str(tmp_path / "mg"), "--out", str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_bit_exact(src, tmp_path / "back")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (tmp_path / "back" / name).is_file(), name
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert model.dtype == torch.bfloat16
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))("1+2=")["input_ids"]
    again = convert("export", "--megatron", str(tmp_path / "mg"), "--out", str(tmp_path / "back"))
    assert again.returncode == 2 and "already exists" in again.stderr and "--overwrite" in again.stderr


def test_train_from_hf_and_export(models, tmp_path):
    """train.py with model.hf_path starts from the HF weights and checkpoint.export_hf writes them
    back: with a learning rate of 1e-30 the exported tensors are the original ones, bit for bit."""
    run_train(["--recipe", "tiny_sft", f"model.hf_path={models['llama']}", "checkpoint.export_hf=true",
               "train.max_steps=2", "optimizer.lr=1e-30", "optimizer.min_lr=0", "data.num_train=500",
               "logging.progress=false", "logging.tensorboard=false", f"logging.run_dir={tmp_path}"])
    assert_bit_exact(models["llama"], tmp_path / "hf")
    assert json.loads((tmp_path / "config.json").read_text())["model"]["family"] == "llama"


# --- bad input: one clear sentence, nothing half-written -------------------------------------------


def test_unsupported_architecture_lists_supported(tmp_path):
    from megatron_rl.hf import model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported Hugging Face architecture GPT2LMHeadModel; supported: "
                                          ".*LlamaForCausalLM.*Qwen3MoeForCausalLM"):
        model_config_from_hf(tmp_path)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_and_truncated_shards(models, tmp_path):
    from megatron_rl.hf.files import HFCheckpoint

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((models["llama"] / "config.json").read_text())
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(models["llama"] / "model.safetensors", sharded / "model-00001-of-00002.safetensors")
    with pytest.raises(ConfigError, match="shard\\(s\\) that are missing: model-00002-of-00002.safetensors"):
        HFCheckpoint(sharded)

    cut = _copy(models["llama"], tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="truncated"):
        HFCheckpoint(cut).names()


def test_config_that_does_not_match_weights(models, one_process, tmp_path):
    bad = _copy(models["llama"], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="config.json implies .* the config does not match the weights"):
        megatron_model(bad)

    extra = _copy(models["llama"], tmp_path / "extra")
    config = json.loads((extra / "config.json").read_text())
    config["num_hidden_layers"] = 2  # the checkpoint has 3
    (extra / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="tensors the model does not use .*model.layers.2"):
        megatron_model(extra)


def test_pickled_weights_need_allow_pickle(models, one_process, tmp_path):
    from megatron_rl.hf import import_hf, model_config_from_hf
    from megatron_rl.training.setup import build_model

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(models["qwen2"] / "config.json", pickled / "config.json")
    torch.save(safetensors_of(models["qwen2"]), pickled / "pytorch_model.bin")
    cfg = Config(model=model_config_from_hf(pickled))
    chunks, _ = build_model(cfg, wrap_ddp=False)
    with pytest.raises(ConfigError, match="pickled .bin weights.*--allow-pickle"):
        import_hf(chunks, cfg.model, pickled)
    import_hf(chunks, cfg.model, pickled, allow_pickle=True)
    chunks[0].eval()
    assert (megatron_logits(chunks[0], TOKENS) - hf_logits(models["qwen2"], TOKENS)).abs().max() <= LOGIT_TOL


def test_export_refuses_existing_target_and_leaves_nothing(models, one_process, tmp_path):
    from megatron_rl.hf import export_hf

    chunks, model = megatron_model(models["qwen2"])
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match="already exists; choose another directory or pass --overwrite"):
        export_hf(chunks, model, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind


def test_transformer_engine_names_map_to_canonical():
    """Names of TE-spec modules (fused norms, grouped experts) map onto the local spec's names."""
    from megatron_rl.hf.weights import canonical_layer_suffix

    assert canonical_layer_suffix("self_attention.linear_qkv.layer_norm_weight", 0) == "input_layernorm.weight"
    assert canonical_layer_suffix("mlp.linear_fc1.layer_norm_bias", 0) == "pre_mlp_layernorm.bias"
    assert canonical_layer_suffix("mlp.experts.linear_fc1.weight3", 8) == "mlp.experts.11.linear_fc1.weight"
    assert canonical_layer_suffix("mlp.experts.local_experts.2.linear_fc2.weight", 4) == "mlp.experts.6.linear_fc2.weight"
    assert canonical_layer_suffix("self_attention.linear_proj.weight", 0) == "self_attention.linear_proj.weight"


def test_deepseek_mtp_layers_are_skipped_with_a_note(models, one_process, tmp_path, capsys):
    """DeepSeek-V3 checkpoints carry multi-token-prediction layers after the decoder layers: they
    are left out, with a note, and the rest still matches transformers."""
    from safetensors.torch import save_file

    path = _copy(models["deepseek_v3"], tmp_path / "mtp")
    tensors = safetensors_of(path)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    tensors[f"model.layers.{layers}.enorm.weight"] = torch.ones(64)
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    chunks, _ = megatron_model(path)
    assert "skipped 2 HF tensors" in capsys.readouterr().out
    assert (megatron_logits(chunks[0], TOKENS) - hf_logits(models["deepseek_v3"], TOKENS)).abs().max() <= LOGIT_TOL
