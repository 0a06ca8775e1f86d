"""DPO and reward models end to end: the first step's ln 2, equal losses and gradient norms across
parallel layouts (TP, SP, PP, CP, DP with the distributed optimizer) and microbatching, the
precomputed reference, a reward model as GRPO's reward at those layouts; data encoding and bad input."""

import json
import math

import pytest

from megatron_rl.checkpointing import checkpoint_dir
from megatron_rl.config import ConfigError, apply_overrides
from megatron_rl.data.rows import DataError
from recipes import get_recipe
from tests.helpers import column, metrics, run_recipes, run_train

pytestmark = [pytest.mark.xdist_group("preference"),  # the tests share one module fixture: one worker runs them
              pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")]
QUICK = ["data.num_train=512", "data.num_val=64", "train.eval_every=0", "scheduler.decay_steps=100",
         "logging.progress=false", "logging.tensorboard=false", "checkpoint.save=false", "train.max_steps=3",
         "data.negatives=plus1:0.5,plus10:0.25,random:0.25"]
# DPO with per-token means and an SFT term (its normalization by the global chosen-token count is
# then part of every comparison); the reward model with centering, and the policy's tokenizer as it is
# (its own pad token), so that GRPO scores with the policy's ids (the learning test's tiny_rm pads with
# eos: its tokenizer differs, and GRPO re-tokenizes the text).
DPO = ["--recipe", "tiny_dpo", *QUICK, "algorithm.average_logprobs=true", "algorithm.sft_loss_weight=0.5",
       "optimizer.lr=1e-3"]
RM = ["--recipe", "tiny_rm", *QUICK, "algorithm.center_rewards_coefficient=0.01", "data.pad_token=",
      "model.num_layers=2"]  # from the 2-layer tiny_sft checkpoint (the recipe trains 6 from scratch)
GRPO_RM = ["--recipe", "tiny_grpo_rm", *QUICK, "train.max_steps=1", "algorithm.prompts_per_step=8", "rollout.n=4",
           "data.micro_batch_size=16"]
LN2 = math.log(2)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """From a briefly trained tiny_sft checkpoint, in one process: DPO (live reference, precomputed
    reference, 4x smaller microbatches), the reward model (saved: GRPO's reward below) and its
    smaller microbatches, GRPO against that reward model."""
    root = tmp_path_factory.mktemp("preference")
    run_train(["--recipe", "tiny_sft", "data.num_train=2000", "data.num_val=64", "train.max_steps=30",
               "train.eval_every=0", "logging.progress=false", "logging.tensorboard=false",
               f"logging.run_dir={root / 'sft'}"])
    load = f"checkpoint.load={checkpoint_dir(root / 'sft', 30)}"
    rm_run = root / "rm"
    proc = run_recipes([
        [*DPO, load, f"logging.run_dir={root / 'dpo'}"],
        [*DPO, load, "algorithm.precompute_reference=true", f"logging.run_dir={root / 'dpo_pre'}"],
        [*DPO, load, "algorithm.precompute_reference=true", f"logging.run_dir={root / 'dpo_pre'}"],  # cached
        [*DPO, load, "data.micro_batch_size=8", f"logging.run_dir={root / 'dpo_mb8'}"],
        [*RM, load, "checkpoint.save=true", f"logging.run_dir={rm_run}"],
        [*RM, load, "data.micro_batch_size=8", f"logging.run_dir={root / 'rm_mb8'}"],
        [*GRPO_RM, load, f"rewards.model={rm_run}", f"logging.run_dir={root / 'grpo_rm'}"],
    ])
    return root, load, proc.stdout


def test_dpo_first_step_is_ln2_and_microbatching_changes_nothing(single):
    root, _, _ = single
    first = metrics(root / "dpo")[:2]
    assert first[0]["val/preference_loss"] == pytest.approx(LN2, abs=1e-6)  # step 0: the policy is its reference
    assert first[1]["train/preference_loss"] == pytest.approx(LN2, abs=1e-6)
    assert first[1]["train/sft_loss"] > 0 and first[1]["train/loss"] > LN2
    for key, tol in (("train/loss", 1e-6), ("train/grad_norm", 1e-5)):
        assert column(root / "dpo_mb8", key) == pytest.approx(column(root / "dpo", key), rel=tol)
    last = metrics(root / "dpo")[-1]
    for key in ("train/preference_accuracy", "train/reward_chosen", "train/reward_rejected", "train/margin",
                "train/logps_chosen", "train/logps_rejected", "val/preference_accuracy", "val/accuracy"):
        assert key in last, key
    assert last["train/margin"] == pytest.approx(last["train/reward_chosen"] - last["train/reward_rejected"])


def test_precomputed_reference_equals_the_live_one_and_is_cached(single):
    root, _, out = single
    for key in ("train/loss", "train/preference_loss", "train/margin"):
        assert column(root / "dpo_pre", key)[-3:] == pytest.approx(column(root / "dpo", key), abs=1e-6)
    assert "MB of weights on each rank) is not kept" in out  # computed once, then the model is dropped
    assert "read from the cache in" in out and "the reference model (not built)" in out  # the second run


def test_reward_model_step_metrics_and_microbatching(single):
    root, _, out = single
    assert "its output layer is dropped and the score head starts fresh" in out
    for key, tol in (("train/loss", 1e-6), ("train/grad_norm", 1e-5)):
        assert column(root / "rm_mb8", key) == pytest.approx(column(root / "rm", key), rel=tol)
    last = metrics(root / "rm")[-1]
    for key in ("train/accuracy", "train/margin", "train/score_chosen_mean", "train/score_chosen_std",
                "train/score_rejected_mean", "train/score_rejected_std", "val/accuracy", "val/accuracy_plus1",
                "val/accuracy_random"):
        assert key in last, key
    grpo = metrics(root / "grpo_rm")[-1]
    for key in ("reward_model/mean", "reward_model/std", "reward_model/min", "reward_model/max", "val/accuracy"):
        assert key in grpo, key
    assert grpo["reward_model/min"] <= grpo["reward_model/mean"] <= grpo["reward_model/max"]
    assert grpo["rollout/reward_mean"] == pytest.approx(grpo["reward_model/mean"])


LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sp=true"], "pp2": ["parallel.pp=2"],
           "cp2": ["parallel.cp=2"], "dp2-distopt": ["parallel.dp=2", "optimizer.distributed=true"]}


def test_layouts_match_single_process(single, tmp_path):
    """DPO, the reward model and GRPO against it at every layout (one torchrun, the layouts in turn),
    from the same weights as the single process. Tolerances: the SFT tests' (fp32, another reduction
    order over 3 Adam steps). At DP2 the ranks sample other prompts than one process, and dynamic
    sampling makes them need different numbers of rounds."""
    root, load, _ = single
    runs = []
    for name, layout in LAYOUTS.items():
        dynamic = ["algorithm.dynamic_sampling=true"] if name.startswith("dp2") else []
        runs += [[*DPO, load, *layout, f"logging.run_dir={tmp_path / name / 'dpo'}"],
                 [*RM, load, *layout, f"logging.run_dir={tmp_path / name / 'rm'}"],
                 [*GRPO_RM, load, *layout, f"rewards.model={root / 'rm'}", *dynamic,
                  f"logging.run_dir={tmp_path / name / 'grpo_rm'}"]]
    run_recipes(runs, nproc=2)
    for name in LAYOUTS:
        out = tmp_path / name
        assert column(out / "dpo", "train/preference_loss")[0] == pytest.approx(LN2, abs=1e-6), name
        for run in ("dpo", "rm"):
            for key, tol in (("train/loss", 1e-5), ("train/grad_norm", 1e-4), ("val/loss", 1e-5)):
                assert column(out / run, key) == pytest.approx(column(root / run, key), rel=tol), (name, run, key)
        got = metrics(out / "grpo_rm")[-1]
        if name.startswith("dp2"):
            assert "rollout/dynamic_sampling_rounds" in got and "reward_model/mean" in got
            continue
        want = metrics(root / "grpo_rm")[-1]
        for key in ("reward_model/mean", "reward_model/std", "train/loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (name, key)


# --- data --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tests.hf_models import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_pairs_share_the_prompt_and_are_truncated_as_asked(tok):
    from megatron_rl.data.preference import encode_pairs, lm_tensors, score_tensors

    rows = [{"prompt": "12+34=", "chosen": "46", "rejected": "47", "answer": "46", "kind": "plus1"},
            {"prompt": "1+1=", "chosen": "2", "rejected": "3333333333"}]
    pairs = encode_pairs(rows, tok, budget=12, source="x")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert pairs[0].prompt[0] == bos and pairs[0].chosen[-1] == eos and not pairs[0].truncated
    assert pairs[0].metadata == {"answer": "46"} and pairs[0].kind == "plus1"
    assert pairs[1].truncated and len(pairs[1].prompt) + len(pairs[1].rejected) == 12  # keep_end: prompt start cut
    assert pairs[1].rejected[-1] == eos and pairs[1].prompt[0] != bos
    start = encode_pairs(rows[1:], tok, budget=12, source="x", mode="keep_start")[0]
    assert start.prompt[0] == bos and start.rejected[-1] != eos  # keep_start: the response's end is cut
    capped = encode_pairs(rows[:1], tok, budget=40, source="x", max_prompt=3, max_completion=2)[0]
    assert capped.truncated and len(capped.prompt) == 3 and capped.chosen == tok("46")["input_ids"]
    lm = lm_tensors(pairs[:1], 16, tok.pad_token_id)
    ids = pairs[0].prompt + pairs[0].chosen
    assert lm["tokens"][0, 0, : len(ids) - 1].tolist() == ids[:-1] and lm["labels"][0, 0, : len(ids) - 1].tolist() == ids[1:]
    assert lm["loss_mask"][0, 0].nonzero().flatten().tolist() == list(range(len(pairs[0].prompt) - 1, len(ids) - 1))
    sc = score_tensors(pairs[:1], 16, tok.pad_token_id)
    assert sc["score_pos"][0].tolist() == [len(ids) - 1, len(pairs[0].prompt + pairs[0].rejected) - 1]  # the eos


def test_conversational_rows_use_the_chat_template(tok, tmp_path):
    from megatron_rl.data.preference import pair_texts
    from tests.hf_models import make_tokenizer

    chat = make_tokenizer(tmp_path)
    chat.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
                         "{% if add_generation_prompt %}<assistant>{% endif %}"
    user = [{"role": "user", "content": "1+2="}]
    row = {"prompt": user, "chosen": [{"role": "assistant", "content": "3"}],
           "rejected": [{"role": "assistant", "content": "4"}]}
    assert pair_texts(row, chat, "x") == ("<user>1+2=<assistant>", "3", "4")
    full = {"chosen": user + row["chosen"], "rejected": user + row["rejected"]}  # a shared message prefix
    assert pair_texts(full, chat, "x") == ("<user>1+2=<assistant>", "3", "4")
    with pytest.raises(DataError, match="x: conversational rows need a chat template, and the tokenizer has none"):
        pair_texts(row, tok, "x")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+1=", "chosen": "2"}, "f:1: a preference row needs 'chosen' and 'rejected'"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "f:1: 'chosen' and 'rejected' are identical"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": 3}, "f:1: 'prompt', 'chosen' and 'rejected' must all be strings"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"}, "f:1: 'margin' must be a number"),
])
def test_bad_preference_rows(tok, row, message):
    from megatron_rl.data.preference import encode_pairs

    with pytest.raises(DataError, match=message):
        encode_pairs([row], tok, budget=16, source="f")


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.beta=0"], "algorithm.beta=0.0 must be positive"),
    (["algorithm.preference_loss=ipo", "algorithm.average_logprobs=false"], "unset algorithm.average_logprobs"),
    (["algorithm.preference_loss=hinge", "algorithm.label_smoothing=0.1"], "needs algorithm.preference_loss=cdpo or robust"),
    (["algorithm.label_smoothing=0.1"], "does nothing to preference_loss=sigmoid .as in TRL.: set algorithm.preference_loss=cdpo"),
    (["algorithm.preference_loss=robust", "algorithm.label_smoothing=0.5"], "algorithm.label_smoothing=0.5 must be in"),
    (["algorithm.name=rm"], "algorithm.name=rm trains a scalar score head: set model.head=score"),
    (["model.head=score"], "set model.head=lm"),
    (["rewards.fn=reward_model"], "rewards.fn=reward_model and rewards.model=PATH go together"),
    (["data.negatives=plus2:1"], "must give non-negative weights (not all 0) to kinds among"),
    (["checkpoint.load="], "DPO starts from a policy, which is also its reference: set checkpoint.load"),
])
def test_contradictory_options_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(get_recipe("tiny_dpo"), overrides).validate(world_size=1)


def test_misused_checkpoints_are_one_line_errors(single, tmp_path):
    """A reward model as a DPO policy and a bad row end the run with exit 2, one sentence, and no run
    directory left behind; a reward model as GRPO's policy and a language model as rewards.model are
    refused the same way (the functions train.py reports from)."""
    from megatron_rl.checkpointing import load_weights, resolve
    from megatron_rl.environments.reward_model import RewardModel

    root, load, _ = single
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "2"}) + "\n")
    cases = [
        (["--recipe", "tiny_dpo", *QUICK, f"checkpoint.load={root / 'rm'}"], "holds a reward model (a scalar score head"),
        (["--recipe", "tiny_dpo", *QUICK, load, "data.task=", f"data.train_path={bad}", "data.tokenizer=" +
          str(root / "sft" / "data" / "tokenizer")], "'chosen' and 'rejected' are identical"),
    ]
    for i, (args, message) in enumerate(cases):
        run_dir = tmp_path / f"run{i}"
        proc = run_train([*args, f"logging.run_dir={run_dir}"], check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
        assert not run_dir.exists()
    with pytest.raises(ConfigError, match="holds a reward model .* trains a language model"):
        load_weights([], resolve(root / "rm"), head="lm")
    with pytest.raises(ConfigError, match="is a language model, not a reward model; train one with algorithm.name=rm"):
        RewardModel(get_recipe("tiny_grpo_rm"), str(root / "sft"), None)


def test_reference_cache_key_follows_every_input(tmp_path, tok):
    from megatron_rl.training.reference import cache_key

    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "model.safetensors").write_text("w")
    (tmp_path / "ref" / "config.json").write_text("{}")
    data = tmp_path / "pairs.jsonl"
    data.write_text("a\n")
    cfg = get_recipe("tiny_dpo")
    cfg.checkpoint.load, cfg.model.hf_path = "", str(tmp_path / "ref")
    key = cache_key(cfg, data, tok)
    assert cache_key(cfg, data, tok) == key
    data.write_text("b\n")
    assert cache_key(cfg, data, tok) != key
    data.write_text("a\n")
    cfg.data.max_completion_length = 3
    assert cache_key(cfg, data, tok) != key
    cfg.data.max_completion_length = 0
    (tmp_path / "ref" / "model.safetensors").write_text("changed weights")
    assert cache_key(cfg, data, tok) != key
