"""The recipes users start from: their architectures are the published models', each fits the GPUs it
is made for (and its docstring gives the planner's verdict), and --list-recipes groups them by family."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, run_train

# The published config.json of each model a recipe names (the fields that fix the architecture).
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
              "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
              "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 16,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "vocab_size": 128256}
QWEN25_32B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 5120,
              "intermediate_size": 27648, "max_position_embeddings": 32768, "max_window_layers": 70,
              "num_attention_heads": 40, "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
              "tie_word_embeddings": False, "vocab_size": 152064}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
                "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                "vocab_size": 32000}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                 "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
                 "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
                 "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
                 "rope_theta": 1000000.0, "tie_word_embeddings": False, "vocab_size": 151936}
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_attention_heads": 64, "num_hidden_layers": 94}


@pytest.mark.parametrize("recipe,hf", [("llama32_1b_grpo", LLAMA32_1B), ("llama32_1b_sft", LLAMA32_1B),
                                       ("qwen25_32b_grpo", QWEN25_32B), ("mixtral_8x7b_grpo", MIXTRAL_8X7B),
                                       ("qwen3_30b_a3b_grpo", QWEN3_30B_A3B),
                                       ("qwen3_235b_a22b_grpo", QWEN3_235B_A22B)])
def test_recipe_architecture_is_the_published_model(recipe, hf, tmp_path):
    """The recipe's model section equals what the model's own config.json gives (the fields a
    checkpoint fixes), so the planner sizes the real model and model.hf_path changes nothing."""
    from megatron_rl.config import ModelConfig
    from megatron_rl.hf import model_config_from_hf
    from recipes import get_recipe

    (tmp_path / "config.json").write_text(json.dumps(hf))
    published, ours = model_config_from_hf(tmp_path), get_recipe(recipe).model
    differ = {f.name: (getattr(ours, f.name), getattr(published, f.name)) for f in dataclasses.fields(ModelConfig)
              if f.name not in ModelConfig.TRAINING_CHOICES and getattr(ours, f.name) != getattr(published, f.name)}
    assert not differ, f"{recipe}: (recipe, published) {differ}"


LARGE = {  # recipe -> published parameter count in billions (DeepSeek-V3 without its MTP layer)
    "llama32_1b_sft": 1.2, "llama32_1b_grpo": 1.2, "qwen25_32b_grpo": 32.8, "qwen25_32b_grpo_lora": 32.8, "qwen3_30b_a3b_grpo": 30.5,
    "qwen3_30b_a3b_grpo_async": 30.5,
    "qwen3_30b_a3b_grpo_gb200": 30.5, "qwen3_235b_a22b_grpo": 235.1, "qwen3_235b_a22b_grpo_gb200": 235.1,
    "mixtral_8x7b_grpo": 46.7, "mixtral_8x7b_grpo_lora": 46.7, "nemotron4_340b_grpo_lora": 341.0, "deepseek_v3_grpo": 671.0, "deepseek_v3_grpo_gb200": 671.0, "nemotron4_340b_grpo": 341.0,
    "nemotron_grpo": 31.6, "nemotron_grpo_gb200": 31.6, "nemotron_h_8b_grpo": 8.1}


def _plan(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/plan.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"})


def test_every_large_recipe_fits_its_gpus_as_its_docstring_says():
    """One planner call over every recipe but the tiny ones, each on the GPU it is made for: all fit,
    the model sizes are the published ones, and each docstring's 'fits, X of Y GB' is the planner's."""
    from recipes import get_recipe, list_recipes

    assert set(LARGE) == {name for name in list_recipes() if not name.startswith(("tiny_", "hf_"))}
    proc = _plan(*(arg for name in LARGE for arg in ("--recipe", name)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = dict(re.findall(r"recipe (\w+): (.*?)(?=\nrecipe |\Z)", proc.stdout, re.S))
    assert set(reports) == set(LARGE)
    for name, report in reports.items():
        params = float(re.search(r"model ([\d.]+)B parameters", report).group(1))
        assert params == LARGE[name], (name, params)
        needs, gpu_gb = re.search(r"FITS: the fullest rank \(stage \d+\) needs ([\d.]+) of (\d+) GB", report).groups()
        doc = " ".join(get_recipe.__globals__["_REGISTRY"][name].__doc__.split())
        said = re.search(r"Planner: fits, ([\d.]+) of (\d+) GB", doc)
        assert said, f"{name}'s docstring does not give the planner's verdict"
        assert said.groups() == (needs, gpu_gb), f"{name}: docstring says {said.group(0)}, the planner {needs} of {gpu_gb}"
    assert "(a100, 80 GB each)" in reports["qwen25_32b_grpo"] and "(gb200, 186 GB each)" in reports["deepseek_v3_grpo_gb200"]


def test_nemotron4_gb200_layout_in_its_docstring_fits():
    import recipes.nemotron

    doc = " ".join(recipes.nemotron.nemotron4_340b_grpo.__doc__.split())
    assert "parallel.pp=6 parallel.dp=2 with --world-size 96" in doc
    proc = _plan("--recipe", "nemotron4_340b_grpo", "--gpu", "gb200", "--world-size", "96", "parallel.pp=6", "parallel.dp=2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_hardware_variants_choose_their_fp8():
    """Blockwise FP8 on H100, MXFP8 on GB200, each with mismatch correction (rollouts run through the
    same FP8 modules); bf16 where the recipe says so."""
    from recipes import get_recipe, recipe_gpu

    for name, recipe in [("qwen3_235b_a22b_grpo", "blockwise"), ("deepseek_v3_grpo", "blockwise"),
                         ("qwen3_30b_a3b_grpo_gb200", "mxfp8"), ("qwen3_235b_a22b_grpo_gb200", "mxfp8"),
                         ("deepseek_v3_grpo_gb200", "mxfp8"), ("nemotron_grpo_gb200", "mxfp8")]:
        cfg = get_recipe(name)
        assert (cfg.fp8.format, cfg.fp8.recipe, cfg.algorithm.mismatch_correction) == ("hybrid", recipe,
                                                                                        "token_truncate"), name
        assert recipe_gpu(name) == ("gb200" if name.endswith("_gb200") else "h100")
    for name in ("qwen3_30b_a3b_grpo", "qwen25_32b_grpo", "llama32_1b_grpo", "mixtral_8x7b_grpo", "nemotron_grpo",
                 "nemotron_h_8b_grpo", "nemotron4_340b_grpo"):
        assert get_recipe(name).fp8.format == "off", name
    assert recipe_gpu("qwen25_32b_grpo") == "a100"


def test_list_recipes_groups_by_family():
    out = run_train(["--list-recipes"]).stdout
    families = re.findall(r"^(\w+):$", out, re.M)
    assert families == ["tiny", "hf", "llama", "qwen", "mixtral", "deepseek", "nemotron"]
    sections = dict(zip(families, re.split(r"^\w+:$", out, flags=re.M)[1:]))
    for family, text in sections.items():
        names = re.findall(r"^  (\w+)\s", text, re.M)
        assert names and all(n.startswith(family) for n in names), (family, names)
    assert re.search(r"^  qwen25_32b_grpo +Qwen2\.5-32B\(-Instruct\), GRPO on math", out, re.M)


def test_real_model_recipe_without_a_checkpoint_is_one_sentence(tmp_path):
    """The quick start run as is, before pointing it at a checkpoint: one sentence saying what to set,
    exit 2, nothing left behind."""
    proc = run_train(["--recipe", "llama32_1b_grpo", f"logging.run_dir={tmp_path / 'run'}"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: data.train_path needs the model's tokenizer: set model.hf_path (a Hugging Face checkpoint, whose "
        "tokenizer is used) or data.tokenizer."]
    assert not (tmp_path / "run").exists()


def test_hf_recipes_train_any_hf_model_with_real_settings(tmp_path):
    """hf_sft and hf_grpo on a Hugging Face Llama: every core (train.threads=0) and packing, GRPO with token-mean
    loss, clip-higher, no KL and truncated importance weights; the recipe's 512-token sequences shortened to
    the model's 128 positions with a line saying so; without model.hf_path, one sentence."""
    from tests.hf_models import save_tiny_model

    hf = save_tiny_model("llama", tmp_path / "llama")
    quiet = ["logging.progress=false", "logging.tensorboard=false", "data.num_train=256", "data.num_val=16"]
    proc = run_train(["--recipe", "hf_sft", f"model.hf_path={hf}", "train.max_steps=2", "train.eval_every=2", *quiet,
                      f"logging.run_dir={tmp_path / 'sft'}", "checkpoint.export_hf=true"])
    assert "data.seq_length=112 (the recipe's 512): the model takes at most 128 positions" in proc.stderr
    saved = json.loads((tmp_path / "sft" / "config.json").read_text())
    assert saved["train"]["threads"] == 0 and saved["data"]["max_tokens_per_microbatch"] == 8 * 112
    run_train(["--recipe", "hf_grpo", f"model.hf_path={tmp_path / 'sft' / 'hf'}", "train.max_steps=1", *quiet,
               "algorithm.prompts_per_step=4", "rollout.n=4", "algorithm.minibatches=2", "data.micro_batch_size=2",
               "rollout.max_new_tokens=6", f"logging.run_dir={tmp_path / 'grpo'}", "checkpoint.save=false"])
    a = json.loads((tmp_path / "grpo" / "config.json").read_text())["algorithm"]
    assert (a["loss_aggregation"], a["clip_high"], a["kl_coef"], a["mismatch_correction"]) == (
        "token", 0.28, 0.0, "token_truncate")
    assert "rollout/logprob_mismatch_max" in json.loads((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()[-1])
    proc = run_train(["--recipe", "hf_dpo", f"logging.run_dir={tmp_path / 'none'}"], check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: recipe hf_dpo needs model.hf_path: add model.hf_path=... to the command line (--print-config shows "
        "the recipe without it).")
