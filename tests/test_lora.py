"""LoRA: adapters beside megatron's linear layers, one per projection of a fused layer; the reference is
the model with its adapters off; the same losses and gradients at every layout; bad settings refused."""

import json

import pytest
import torch

from megatron_rl.checkpointing import checkpoint_dir
from megatron_rl.config import Config, ConfigError
from megatron_rl.training.lora import adapters_off as lora_off
from model_providers.builder import is_adapter
from tests.helpers import column, metrics, processes, run_recipes, run_tool, run_train

pytestmark = [pytest.mark.xdist_group("lora"),  # the end-to-end tests share one module fixture
              pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")]

RANK, ALPHA = 4, 8.0


def _lora_model(moe=False, **lora):
    from megatron_rl.training.setup import build_model

    from recipes.tiny import tiny_model, tiny_moe_model

    cfg = Config()
    cfg.model = tiny_moe_model() if moe else tiny_model()
    cfg.model.vocab_size = 16
    cfg.data.seq_length, cfg.data.micro_batch_size = 8, 2
    cfg.lora.rank, cfg.lora.alpha = RANK, ALPHA
    for k, v in lora.items():
        setattr(cfg.lora, k, v)
    chunks, _ = build_model(cfg, wrap_ddp=False, adapters=True)
    return cfg, chunks


def _logprobs(cfg, chunks):
    from megatron_rl.training.policy import logprobs_of
    from megatron_rl.data import rl as rl_data

    batch = {**rl_data.pack([[1, 5, 6], [1, 7]], [[3, 4, 2], [9, 9, 9, 2]], 8, 0), "index": torch.arange(2)}
    return logprobs_of(chunks, batch, cfg)


def test_adapters_add_their_low_rank_update_and_switch_off(one_process):
    """Output = base + (alpha / rank) B A x: equal to the model whose weights have the update merged, and
    with the adapters off equal to the base; each projection's adapter changes only its own rows of the
    fused layer (per query group: q heads, then k, then v; [gate; up])."""
    from megatron_rl.training import lora

    cfg, chunks = _lora_model()
    model = chunks[0]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    base = _logprobs(cfg, chunks)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "_lora.b." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    adapted = _logprobs(cfg, chunks)
    assert not torch.allclose(adapted, base, atol=1e-3)
    with lora.adapters_off(chunks):
        assert torch.equal(_logprobs(cfg, chunks), base)
    assert torch.equal(_logprobs(cfg, chunks), adapted)  # back on

    attention = model.decoder.layers[0].self_attention
    m = cfg.model
    d, per_group = m.hidden_size // m.num_attention_heads, m.num_attention_heads // m.num_query_groups
    for only in ("q", "k", "v"):
        with torch.no_grad():
            saved = {s: b.weight.clone() for s, b in attention.linear_qkv_lora.b.items()}
            for s, b in attention.linear_qkv_lora.b.items():
                if s != only:
                    b.weight.zero_()
            rows = attention.linear_qkv_lora.delta().abs().sum(dim=1).view(m.num_query_groups, -1) > 0
            for s, b in attention.linear_qkv_lora.b.items():
                b.weight.copy_(saved[s])
        start = {"q": 0, "k": per_group * d, "v": (per_group + 1) * d}[only]
        size = per_group * d if only == "q" else d
        expected = torch.zeros_like(rows)
        expected[:, start:start + size] = True
        assert torch.equal(rows, expected), only
    mlp = model.decoder.layers[0].mlp
    with torch.no_grad():
        mlp.linear_fc1_lora.b["up"].weight.zero_()
        rows = mlp.linear_fc1_lora.delta().abs().sum(dim=1) > 0
    assert rows[: m.ffn_hidden_size].all() and not rows[m.ffn_hidden_size:].any()  # [gate; up]

    adapted = _logprobs(cfg, chunks)
    lora.merge_and_reset(chunks, cfg.model, cfg.train.seed)  # W += (alpha / rank) B A; B back to zero
    assert all(not b.weight.any() for a in lora.adapter_modules(chunks) for b in a.b.values())
    assert torch.allclose(_logprobs(cfg, chunks), adapted, atol=1e-5)


def test_bad_targets_are_refused(one_process):
    with pytest.raises(ConfigError, match="lora.targets nothing match no linear layer"):
        _lora_model(targets=("linear_qkv", "nothing"))
    with pytest.raises(ConfigError, match="adapters on experts are not supported yet"):
        _lora_model(moe=True, targets=("*.experts.*",))
    _, (moe,) = _lora_model(moe=True)  # every MLP is MoE: attention gets adapters, experts none
    names = [n for n, p in moe.named_parameters() if p.requires_grad]
    assert names and all("self_attention" in n for n in names)

@pytest.mark.parametrize("recipe, overrides, message", [
    ("tiny_sft", ["lora.rank=-1"], "lora.rank=-1 must be >= 1"),
    ("tiny_sft", ["lora.rank=8", "lora.alpha=0"], "lora.alpha=0.0 must be positive"),
    ("tiny_sft", ["lora.rank=3", "parallel.tp=2"], "lora.rank=3 must be divisible by parallel.tp=2"),
    ("tiny_grpo_lora", ["lora.dropout=0.1"], "lora.dropout=0.1 is refused for algorithm.name=grpo"),
    ("tiny_sft", ["lora.adapter=somewhere"], "lora.adapter='somewhere' needs lora.rank"),
])
def test_bad_settings_are_refused(recipe, overrides, message):
    from megatron_rl.config import apply_overrides
    from recipes import get_recipe

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(get_recipe(recipe), overrides).validate(world_size=2 if "parallel.tp=2" in overrides else 1)
    apply_overrides(get_recipe("tiny_dpo_lora"), ["lora.dropout=0.1"]).validate(world_size=1)  # fine off-policy


# --- end to end, from one step of tiny_sft ------------------------------------------------------------------

FAST = ["data.num_train=2000", "data.micro_batch_size=32", "data.num_val=32", "train.eval_every=0",
        "scheduler.decay_steps=100", "logging.progress=false", "logging.tensorboard=false", "checkpoint.save=false"]
LORA = [f"lora.rank={RANK}", f"lora.alpha={ALPHA}"]
# GRPO with a KL penalty: rollouts on the model with its adapters, the reference with them off.
# tiny_gdpo's 'digits' reward is non-zero from the start; micro batch 8 so that PP runs several microbatches.
GRPO = ["--recipe", "tiny_gdpo", *FAST, *LORA, "algorithm.kl_coef=0.05", "train.max_steps=2",
        "algorithm.prompts_per_step=8", "rollout.n=4", "data.micro_batch_size=8"]
SFT = ["--recipe", "tiny_sft", *FAST, *LORA, "train.max_steps=3", "data.micro_batch_size=16"]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """tiny_sft after one step (a checkpoint without adapters), and the single-process LoRA runs from it."""
    root = tmp_path_factory.mktemp("lora")
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=1", "checkpoint.save=true",
               f"logging.run_dir={root / 'init'}"])
    init = f"checkpoint.load={checkpoint_dir(root / 'init', 1)}"
    run_recipes([[*SFT, init, f"logging.run_dir={root / 'sft'}"]])
    proc = run_recipes([[*GRPO, init, f"logging.run_dir={root / 'grpo'}"]])
    (root / "grpo" / "stdout.txt").write_text(proc.stdout)
    return init, root


def test_lora_grpo_trains_adapters_only_against_the_base(start):
    """Step 1: B = 0, so the policy is its reference (KL exactly 0); then the adapters move it away. The
    rollouts run on the model with its adapters: their log-probs equal training's within the usual bound."""
    _, root = start
    rows = [r for r in metrics(root / "grpo") if "train/kl" in r]
    assert rows[0]["train/kl"] == 0 and rows[-1]["train/kl"] > 0
    assert max(r["rollout/logprob_mismatch_max"] for r in rows) <= 2e-6
    # Per layer, rank 4: q, k, v 1024 + 768 + 768, proj 1024, gate and up 2 x 2560, fc2 2560; two layers.
    assert "LoRA (rank 4, alpha 8): 22,528 trainable parameters of" in (root / "grpo" / "stdout.txt").read_text()


@pytest.mark.parametrize("kind,layout", [("sft", ["parallel.tp=2"]), ("sft", ["parallel.dp=2", "optimizer.distributed=true"]),
                                         ("grpo", ["parallel.tp=2", "parallel.sp=true"]), ("grpo", ["parallel.pp=2"]),
                                         ("grpo", ["parallel.cp=2"])],
                         ids=["sft-tp2", "sft-dp2-distopt", "grpo-tp2-sp", "grpo-pp2", "grpo-cp2"])
def test_lora_layouts_match_single_process(start, kind, layout, tmp_path):
    """A is drawn over its full fan-in per canonical tensor, so the adapters start the same at every layout:
    the same losses, gradient norms (and KL) as one process."""
    init, root = start
    run_train([*(SFT if kind == "sft" else GRPO), init, *layout, f"logging.run_dir={tmp_path}"], nproc=processes(layout))
    for key in ("train/loss", "train/grad_norm", *(("train/kl", "rollout/reward_mean") if kind == "grpo" else ())):
        assert column(tmp_path, key) == pytest.approx(column(root / kind, key), rel=1e-5, abs=1e-8), key


def test_lora_resumes_bitwise_and_a_stacked_stage_starts_from_the_merged_model(start, tmp_path):
    """A LoRA run's checkpoints hold its adapters and name its base: resumed from step 2 it repeats step 3
    bitwise. A later LoRA stage loading that checkpoint merges its adapters into the base and starts fresh
    ones: with lr 1e-30 it evaluates as the earlier stage ended. Adapters whose base has changed since, and
    a full fine-tune from a LoRA checkpoint, are refused in one sentence."""
    import shutil

    init, root = start
    base, split = tmp_path / "base", tmp_path / "split"
    shutil.copytree(init.split("=", 1)[1], base)
    keep = [f"checkpoint.load={base}", "checkpoint.save=true", "checkpoint.save_every=2", "train.eval_every=0"]
    run_train([*SFT, *keep, "train.max_steps=2", f"logging.run_dir={split}"])
    run_train([*SFT, *keep, "checkpoint.resume=true", f"logging.run_dir={split}"])
    assert column(split, "train/loss") == column(root / "sft", "train/loss")
    assert column(split, "train/grad_norm") == column(root / "sft", "train/grad_norm")
    saved = checkpoint_dir(split, 3)
    size = lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())  # noqa: E731
    assert size(saved) < 0.5 * size(base)  # adapters and their Adam state: 0.5 MB, the base 6.2 MB
    stacked = tmp_path / "stacked"
    run_train([*SFT, f"checkpoint.load={saved}", "train.max_steps=1", "optimizer.lr=1e-30",
               "optimizer.min_lr=1e-30", f"logging.run_dir={stacked}"])
    assert column(stacked, "val/loss")[-1] == pytest.approx(column(split, "val/loss")[-1], rel=1e-6)
    full = run_train(["--recipe", "tiny_sft", *FAST, f"checkpoint.load={saved}", f"logging.run_dir={tmp_path / 'full'}"],
                     check=False)
    assert full.returncode == 2 and "holds LoRA adapters: continue from it with lora.rank=4" in full.stderr
    evaluated = run_tool("eval.py", ["--checkpoint", str(split), "--data", str(split / "data" / "val.jsonl"),
                                     "--out", str(tmp_path / "eval.json")])  # the adapters merged into their base
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads((tmp_path / "eval.json").read_text())["greedy_accuracy"] == column(split, "val/accuracy")[-1]

    other = tmp_path / "other"
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=1", "train.seed=7", "checkpoint.save=true",
               f"logging.run_dir={other}"])
    shutil.rmtree(base)
    shutil.copytree(checkpoint_dir(other, 1), base)
    moved = run_train([*SFT, *keep, "train.max_steps=4", "checkpoint.resume=true", f"logging.run_dir={split}"],
                      check=False)
    assert moved.returncode == 2 and "were trained on another base than" in moved.stderr, moved.stderr[-2000:]


def _convert(*args):
    return run_tool("convert_checkpoint.py", list(args))


def test_merged_and_peft_exports_match_the_adapter_model(one_process, tmp_path):
    """LoRA SFT from an HF Llama (trained at TP2): the merged HF export and the PEFT adapter on the base (as the
    peft package loads it) give the adapter model's logits within 1e-5; the PEFT adapter imported onto the base
    (lora.adapter) is the trained adapters exactly; bad exports and adapters are refused in one sentence."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_rl import checkpointing
    from megatron_rl.hf import import_hf, model_config_from_hf
    from megatron_rl.hf.peft import import_peft
    from megatron_rl.training.setup import build_model
    from tests.hf_models import VOCAB, hf_logits, save_tiny_model

    hf = save_tiny_model("llama", tmp_path / "hf")
    run_train(["--recipe", "tiny_sft", f"model.hf_path={hf}", *LORA, "train.max_steps=3", "optimizer.lr=3e-2",
               "data.num_train=500", "parallel.tp=2", "logging.progress=false", "logging.tensorboard=false",
               f"logging.run_dir={tmp_path / 'run'}"], nproc=2)
    ckpt = checkpoint_dir(tmp_path / "run", 3)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for out, flag in ((merged, "--merge-lora"), (adapter, "--adapter-only")):
        proc = _convert("export", "--megatron", str(ckpt), "--out", str(out), flag)
        assert proc.returncode == 0, proc.stderr
    bare = _convert("export", "--megatron", str(ckpt), "--out", str(tmp_path / "bare"))
    assert bare.returncode == 2 and "--merge-lora" in bare.stderr and not (tmp_path / "bare").exists()

    cfg = Config(model=model_config_from_hf(hf))
    cfg.lora.rank, cfg.lora.alpha = RANK, ALPHA
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))

    def logits(chunks):
        with torch.no_grad():
            return chunks[0](tokens, torch.arange(12).expand_as(tokens), None)[..., :VOCAB]

    ours, _ = build_model(cfg, wrap_ddp=False, adapters=True)
    import_hf(ours, cfg.model, hf)  # the checkpoint holds the adapters and names this base
    assert checkpointing.saved_lora(ckpt)["base"]["path"] == str(hf.resolve())
    checkpointing.load_weights(ours, ckpt, "lm", cfg.lora)
    adapted = logits(ours)
    with lora_off(ours):
        assert not torch.allclose(logits(ours), adapted, atol=1e-3)  # the adapters matter
    assert (hf_logits(merged, tokens) - adapted).abs().max() < 1e-5
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32), str(adapter))
    with torch.no_grad():
        assert (peft_model(tokens).logits - adapted).abs().max() < 1e-5

    imported, _ = build_model(cfg, wrap_ddp=False, adapters=True)
    import_hf(imported, cfg.model, hf)
    import_peft(imported, cfg.model, cfg.lora, adapter)
    assert torch.equal(logits(imported), adapted)
    cfg.lora.rank = 2 * RANK
    with pytest.raises(ConfigError, match=f"set lora.rank={RANK} lora.alpha={ALPHA}"):
        import_peft(build_model(cfg, wrap_ddp=False, adapters=True)[0], cfg.model, cfg.lora, adapter)
    cfg.lora.rank, cfg.lora.targets = RANK, ("linear_qkv",)
    with pytest.raises(ConfigError, match="does not fit this model and lora.targets: it has .*down_proj.lora_A.weight, which no adapter"):
        import_peft(build_model(cfg, wrap_ddp=False, adapters=True)[0], cfg.model, cfg.lora, adapter)
