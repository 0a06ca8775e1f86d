"""Sequence packing (data.max_tokens_per_microbatch): the packed layout, no attention across samples,
and SFT, GRPO and DPO steps equal to the unpacked ones in one process and at TP2 (+SP), PP2 and CP2."""

import pytest
import torch

from megatron_rl.checkpointing import checkpoint_dir
from megatron_rl.data import packing
from tests.helpers import column, run_recipes

pytestmark = [pytest.mark.xdist_group("packing"),  # the tests share one module fixture: one worker runs them
              pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")]

# Operands of up to 8 digits: samples of 5 to 30 tokens, so packs hold segments of 16 and 32 tokens.
QUICK = ["data.digits=8", "data.seq_length=32", "data.num_train=512", "data.num_val=64", "train.eval_every=0",
         "logging.progress=false", "logging.tensorboard=false", "checkpoint.save=false"]
SFT = ["--recipe", "tiny_sft", *QUICK, "train.max_steps=3", "data.micro_batch_size=16"]
GRPO = ["--recipe", "tiny_grpo", *QUICK, "train.max_steps=2", "algorithm.prompts_per_step=8",
        "data.micro_batch_size=16", "rollout.max_sequence_length=64"]
GSPO = [*GRPO, "algorithm.ratio_level=sequence", "algorithm.loss_aggregation=sequence",
        "algorithm.mismatch_correction=sequence_truncate", "algorithm.minibatches=2"]
DPO = ["--recipe", "tiny_dpo", *QUICK, "train.max_steps=2", "data.micro_batch_size=8", "algorithm.sft_loss_weight=0.5",
       "data.negatives=plus1:0.5,plus10:0.25,random:0.25"]
PACKED = ["data.max_tokens_per_microbatch=96"]
RUNS = {"sft": SFT, "grpo": GRPO, "gspo": GSPO, "dpo": DPO}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """In one process: a briefly trained SFT start, then each algorithm unpacked and packed."""
    root = tmp_path_factory.mktemp("packing")
    start = root / "start"
    runs = [["--recipe", "tiny_sft", *QUICK, "train.max_steps=20", "checkpoint.save=true", f"logging.run_dir={start}"]]
    load = f"checkpoint.load={checkpoint_dir(start, 20)}"  # the same weights at every layout
    for name, argv in RUNS.items():
        runs += [[*argv, load, f"logging.run_dir={root / name}"],
                 [*argv, load, *PACKED, f"logging.run_dir={root / name / 'packed'}"]]
    run_recipes(runs)
    return root


def _same(got, want, name):
    for key, tol in (("train/loss", 1e-6), ("train/grad_norm", 1e-5)):
        # abs: GSPO's first loss is rounding noise about 0 (2e-9 and 5e-9 on one CPU, 5e-9 both on another)
        assert column(got, key) == pytest.approx(column(want, key), rel=tol, abs=1e-8), (name, key)


@pytest.mark.parametrize("name", RUNS)
def test_packed_steps_equal_unpacked(single, name):
    _same(single / name / "packed", single / name, name)
    if name in ("grpo", "gspo"):
        assert column(single / name / "packed", "rollout/reward_mean") == column(single / name, "rollout/reward_mean")
        # the engine's logprobs equal the packed training forward's as they equal the unpacked one's
        assert max(column(single / name / "packed", "rollout/logprob_mismatch_max")) <= 2e-6


LAYOUTS = {"tp2-sp": ["parallel.tp=2", "parallel.sp=true"], "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"]}


def test_packed_steps_at_layouts_equal_unpacked_single_process(single, tmp_path):
    load = f"checkpoint.load={checkpoint_dir(single / 'start', 20)}"
    runs = [[*argv, load, *PACKED, *layout, f"logging.run_dir={tmp_path / lname / name}"]
            for lname, layout in LAYOUTS.items() for name, argv in RUNS.items() if name != "gspo"]
    run_recipes(runs, nproc=2)
    for lname in LAYOUTS:
        for name in RUNS:
            if name != "gspo":
                _same(tmp_path / lname / name, single / name, f"{lname}/{name}")


# --- the layout and the attention -----------------------------------------------------------------

def test_groups_fit_the_budget_and_keep_units_whole():
    lengths = [30, 5, 17, 12, 32, 3, 20]
    chosen = packing.groups(lengths, 48)
    assert sorted(i for g in chosen for i in g) == list(range(7))
    assert all(sum(lengths[i] for i in g) <= 48 for g in chosen) and len(chosen) == 3  # 119 tokens: 3 is the least
    split = packing.split_to(chosen, 6)
    assert len(split) == 6 and sorted(i for g in split for i in g) == list(range(7))
    assert all(any(set(g) <= set(c) for c in chosen) for g in split)  # only splits: still within the budget
    with pytest.raises(ValueError, match="cannot make"):
        packing.split_to([[0], [1]], 3)


def test_pack_places_samples_in_segments():
    mask = torch.zeros(3, 40)
    for i, (a, b) in enumerate([(2, 5), (3, 20), (1, 33)]):
        mask[i, a:b] = 1
    mb = {"tokens": torch.arange(120).view(3, 40), "loss_mask": mask, "advantages": torch.ones(3)}
    out = packing.pack(mb, 16, total=128)  # as with context parallelism: lengths rounded up
    assert out["pack_cu"].tolist() == [0, 16, 48, 96, 128]  # 5 -> 16, 20 -> 32, 33 -> 48 tokens; filler to 128
    assert out["tokens"].shape == (3, 40) and out["advantages"].shape == (3,)  # the grid is at most S wide
    row = packing.packed_row(out["tokens"], out, fill=-1)[0]
    assert row[:16].tolist() == list(range(16)) and row[16:48].tolist() == list(range(40, 72))
    assert row[96:].eq(-1).all()  # filler
    assert row[48:88].tolist() == list(range(80, 120)) and row[88:96].eq(-1).all()  # 48 > S = 40: cut at the grid


@pytest.mark.parametrize("s,budget", [(48, 128), (224, 512)], ids=["short", "long"])
def test_packed_forward_equals_unpacked_and_no_sample_sees_another(one_process, s, budget):
    """Logits of every sample in a pack equal its unpacked forward's bit for bit, and changing one
    sample's tokens changes no other sample's logits. Long rows: samples beyond attention.ONE_PASS_KEYS
    keys are padded to the training length as unpacked rows are."""
    from megatron_rl.config import Config
    from megatron_rl.training.setup import build_trainee
    from megatron_rl.training.step import forward_only, make_microbatches

    cfg = Config()
    cfg.model.vocab_size, cfg.data.seq_length = 20, s
    trainee = build_trainee(cfg)
    g = torch.Generator().manual_seed(0)
    n = 8
    lengths = torch.randint(4, s, (n,), generator=g)
    tokens = torch.randint(1, 20, (n, s), generator=g)
    mask = torch.zeros(n, s)
    for i, length in enumerate(lengths):
        mask[i, 1:length] = 1
        tokens[i, length:] = 0
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": mask, "index": torch.arange(n)}

    def logits(b, budget):
        cfg.data.max_tokens_per_microbatch = budget
        out = torch.zeros(n, s, 128)  # the padded vocabulary

        def collect(mb, x):
            out[mb["index"][:, None], mb["positions"][None, :]] = x.float()

        micro = make_microbatches(cfg, b, 4)
        assert all("pack_cu" in m for m in micro) == bool(budget)
        forward_only(trainee.model, micro, collect)
        return out

    seen = mask > 0
    unpacked, packed = logits(batch, 0), logits(batch, budget)
    assert torch.equal(packed[seen], unpacked[seen])
    changed = {**batch, "tokens": batch["tokens"].clone()}
    changed["tokens"][3, : lengths[3]] = (changed["tokens"][3, : lengths[3]] % 19) + 1
    after = logits(changed, budget)
    others = seen.clone()
    others[3] = False
    assert torch.equal(after[others], packed[others]) and not torch.equal(after[3][seen[3]], packed[3][seen[3]])
