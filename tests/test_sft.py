"""SFT end to end: learning, bitwise resume, and equal losses across parallel layouts (TP, SP, PP,
VPP, CP, EP, DP with the distributed optimizer, TP x PP)."""

import shutil

import pytest
import torch

from megatron_rl.checkpointing import checkpoint_dir
from megatron_rl.data.batches import Batches
from tests.helpers import column, metrics, processes, run_train

pytestmark = pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")

# Small and fast: a few thousand samples, short schedule fixed independently of max_steps.
FAST = ["data.num_train=2000", "data.micro_batch_size=32", "data.num_val=128", "train.eval_every=0", "scheduler.decay_steps=100",
        "logging.progress=false", "logging.tensorboard=false"]


def test_batches_walk_each_epoch_once():
    """10 samples in batches of 4: each epoch's permutation is taken whole, in order, across epoch ends
    (batch 3 is the first epoch's last 2 samples and the second's first 2); the position moves by the
    batch size; DP ranks take every dp-th sample of the same global batch; a resumed stream goes on."""
    data = {"x": torch.arange(10)}
    stream = Batches(data, 4, seed=3)
    got = [stream.next()["x"] for _ in range(5)]
    assert stream.consumed == 20
    order = [Batches(data, 4, seed=3)._order(e) for e in (0, 1)]
    assert torch.equal(torch.cat(got), torch.cat(order))  # two whole epochs, nothing skipped or repeated
    assert sorted(torch.cat(got[:2] + [got[2][:2]]).tolist()) == list(range(10))
    ranks = [Batches(data, 4, seed=3, dp_rank=r, dp_size=2) for r in (0, 1)]
    for batch in got:
        mine = [rank.next()["x"] for rank in ranks]
        assert torch.equal(torch.stack(mine, dim=1).flatten(), batch)
    resumed = Batches(data, 4, seed=3)
    resumed.load_state_dict({"consumed": 8})
    assert torch.equal(resumed.next()["x"], got[2])


def test_every_kind_of_problem_is_in_training_and_validation(tmp_path):
    """The arithmetic split holds out one problem in ten of every kind: validation drawn first from the
    whole space took 88 of the 100 one-digit sums (tiny_sft's split), which training then never saw."""
    import json
    from collections import defaultdict

    from megatron_rl.data import arithmetic

    train, val = arithmetic.write_splits(tmp_path, 50000, 512, 2, seed=0, noise=0.45)  # tiny_sft's
    prompts = {name: defaultdict(set) for name in ("train", "val")}
    for name, path in (("train", train), ("val", val)):
        for line in path.read_text().splitlines():
            a, b = json.loads(line)["prompt"][:-1].split("+")
            prompts[name][len(a), len(b)].add(f"{a}+{b}")
    assert not set().union(*prompts["train"].values()) & set().union(*prompts["val"].values())
    one_digit = prompts["val"][1, 1], prompts["train"][1, 1]
    assert 0 < len(one_digit[0]) <= 15 and len(one_digit[1]) >= 85, [len(p) for p in one_digit]
    assert all(prompts["train"][kind] for kind in prompts["val"])


def test_resume_is_bitwise(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=6", f"logging.run_dir={straight}"])
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=3", f"logging.run_dir={split}"])
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=6", "checkpoint.resume=true",
              f"logging.run_dir={split}"])
    assert [r["step"] for r in metrics(split)] == [1, 2, 3, 4, 5, 6]
    assert column(split, "train/loss") == column(straight, "train/loss")  # bitwise
    assert column(split, "train/grad_norm") == column(straight, "train/grad_norm")
    assert column(split, "val/loss")[-1] == column(straight, "val/loss")[-1]  # split also evaluated at 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Initial weights saved at TP=1 (after one step), and the single-process losses from them."""
    root = tmp_path_factory.mktemp("equiv")
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=1", f"logging.run_dir={root / 'init'}"])
    ckpt = checkpoint_dir(root / "init", 1)
    single = root / "single"
    run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=4", f"checkpoint.load={ckpt}",
               f"logging.run_dir={single}"])
    return ckpt, column(single, "train/loss"), column(single, "train/grad_norm"), single


# Loss tolerance: fp32 with a different reduction order (TP all-reduce, DP split, CP's split of each
# sequence) over 4 Adam steps.
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true"], ["parallel.pp=2"],
                                    ["parallel.cp=2"], ["parallel.dp=2", "optimizer.distributed=true"],
                                    ["parallel.tp=2", "parallel.pp=2"]],
                         ids=["tp2", "tp2-sp", "pp2", "cp2", "dp2-distopt", "tp2xpp2"])
def test_parallel_layouts_match_single_process(reference, layout, tmp_path):
    ckpt, losses, norms, single = reference
    used_below = (["parallel.tp=2"], ["parallel.dp=2", "optimizer.distributed=true"])  # their checkpoints
    save = "true" if layout in used_below else "false"
    run_train(["--recipe", "tiny_sft", *FAST, *layout, "train.max_steps=4", f"checkpoint.load={ckpt}",
               "checkpoint.save_every=2", "checkpoint.keep=0", f"checkpoint.save={save}",
               f"logging.run_dir={tmp_path}"], nproc=processes(layout))
    assert column(tmp_path, "train/loss") == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert column(tmp_path, "train/grad_norm") == pytest.approx(norms, rel=1e-4)
    if layout == ["parallel.tp=2"]:
        # And back: the TP2 run's final checkpoint loads in one process, giving the same val/loss
        # as the single-process run's own final checkpoint (evaluated after 1 more step each).
        def one_step_from(run):
            out = run.parent / f"{run.name}_back"
            run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=1", "checkpoint.save=false",
                       f"checkpoint.load={checkpoint_dir(run, 4)}", f"logging.run_dir={out}"])
            return column(out, "train/loss") + column(out, "val/loss")
        assert one_step_from(tmp_path) == pytest.approx(one_step_from(single), rel=1e-5)
    if "optimizer.distributed=true" in layout:
        # Resuming the distributed optimizer from step 2 repeats steps 3 and 4 bitwise.
        resumed = tmp_path.parent / f"{tmp_path.name}_resumed"
        shutil.copytree(checkpoint_dir(tmp_path, 2), checkpoint_dir(resumed, 2))
        run_train(["--recipe", "tiny_sft", *FAST, *layout, "train.max_steps=4", "checkpoint.resume=true",
                   "checkpoint.save=false", f"logging.run_dir={resumed}"], nproc=2)
        assert column(resumed, "train/loss") == column(tmp_path, "train/loss")[2:]
        assert column(resumed, "train/grad_norm") == column(tmp_path, "train/grad_norm")[2:]
        proc = run_train(["--recipe", "tiny_sft", *FAST, "train.max_steps=6", "checkpoint.resume=true",
                          f"logging.run_dir={resumed}"], check=False)
        assert proc.returncode == 2 and "resume with optimizer.distributed=true" in proc.stderr


def test_bf16_tracks_fp32(reference, tmp_path):
    """bf16 parameters with fp32 main weights (megatron's mixed-precision optimizer), from the same
    weights: the losses follow fp32 to within bf16's precision (8 bits of mantissa: ~0.4%)."""
    ckpt, losses, _, _ = reference
    run_train(["--recipe", "tiny_sft", *FAST, "train.precision=bf16", "train.max_steps=4",
               f"checkpoint.load={ckpt}", "checkpoint.save=false", f"logging.run_dir={tmp_path}"])
    bf16 = column(tmp_path, "train/loss")
    assert bf16 == pytest.approx(losses, rel=1e-2)
    assert bf16 != losses  # it really ran in bf16


@pytest.mark.xdist_group("tiny_sft")
def test_tiny_sft_learns(sft_run):
    """The tiny_sft recipe in full (the GRPO tests' starting point, trained once per session) learns:
    its held-out accuracy is the decent-but-improvable start the GRPO recipes are tuned for."""
    rows = metrics(sft_run)
    first, last = rows[0], rows[-1]
    assert last["step"] == 2000 and last["train/loss"] < 0.6 * first["train/loss"]
    assert last["val/accuracy"] > 0.25  # 35-74% measured (one thread, 3 seeds); chance is ~1/199 for 2-digit sums
    assert (sft_run / "checkpoints").is_dir() and (sft_run / "config.json").is_file()
    assert (sft_run / "hf_assets" / "tokenizer.json").is_file()
    for key in ("train/lr", "perf/step_time_s", "perf/tokens_per_s", "val/loss"):
        assert key in last


@pytest.mark.xdist_group("tiny_sft")
def test_a_run_directory_exports_and_encodes_as_it_trained(sft_run, tmp_path):
    """tools/convert_checkpoint.py export takes the run directory (its latest checkpoint, named); the exported
    tokenizer's plain tokenizer(prompt) gives the ids training and rollouts gave ([bos] prompt), and the
    exported model's greedy answers are the run's: transformers alone scores as the run's validation did."""
    import json

    import transformers

    from megatron_rl.data.tokenizer import prompt_ids
    from megatron_rl.data.tokenizer import load_tokenizer
    from tests.helpers import run_tool

    out = tmp_path / "hf"
    proc = run_tool("convert_checkpoint.py", ["export", "--megatron", str(sft_run), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert f"{sft_run}: its latest complete checkpoint, step_0002000" in proc.stdout
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    rows = [json.loads(line) for line in (sft_run / "data" / "val.jsonl").read_text().splitlines()][:128]
    prompts = [r["prompt"] for r in rows]
    assert [tok(p)["input_ids"] for p in prompts] == prompt_ids(load_tokenizer(sft_run / "hf_assets"), prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    right = 0
    for row in rows:  # one at a time: no padding to reason about
        ids = tok(row["prompt"], return_tensors="pt")["input_ids"]
        new = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        right += tok.decode(new, skip_special_tokens=True).strip() == row["answer"]
    assert right / len(rows) > 0.4, right  # the run's own held-out accuracy is 50-66%; without bos, near 0


def test_virtual_pipeline_matches_single_process(tmp_path):
    """PP=2 with 2 model chunks per stage (interleaved 1F1B) on a 4-layer model, for SFT (4
    microbatches: the steady state sends activations and gradients both ways at once) and a GRPO
    step (rollouts go round the chunks; tiny_gdpo's 'digits' reward is non-zero from the start)."""
    four = [*FAST, "model.num_layers=4"]
    run_train(["--recipe", "tiny_sft", *four, "train.max_steps=1", f"logging.run_dir={tmp_path / 'init'}"])
    init = f"checkpoint.load={checkpoint_dir(tmp_path / 'init', 1)}"
    start = [init, "checkpoint.save=false", "train.max_steps=3", "data.micro_batch_size=16"]
    run_train(["--recipe", "tiny_sft", *four, *start, f"logging.run_dir={tmp_path / 'single'}"])
    run_train(["--recipe", "tiny_sft", *four, *start, "parallel.pp=2", "parallel.vpp=2",
               f"logging.run_dir={tmp_path / 'vpp'}"], nproc=2)
    assert column(tmp_path / "vpp", "train/loss") == pytest.approx(column(tmp_path / "single", "train/loss"), rel=1e-5)
    assert column(tmp_path / "vpp", "train/grad_norm") == pytest.approx(
        column(tmp_path / "single", "train/grad_norm"), rel=1e-5)

    grpo = ["--recipe", "tiny_gdpo", *FAST, "model.num_layers=4", init, "checkpoint.save=false", "train.max_steps=1",
            "data.num_val=32"]
    run_train([*grpo, f"logging.run_dir={tmp_path / 'grpo_single'}"])
    run_train([*grpo, "parallel.pp=2", "parallel.vpp=2", f"logging.run_dir={tmp_path / 'grpo_vpp'}"], nproc=2)
    single, vpp = metrics(tmp_path / "grpo_single")[-1], metrics(tmp_path / "grpo_vpp")[-1]
    assert vpp["rollout/reward_mean"] == single["rollout/reward_mean"] > 0  # the same samples
    assert vpp["train/loss"] == pytest.approx(single["train/loss"], rel=1e-5)
    assert vpp["train/grad_norm"] == pytest.approx(single["train/grad_norm"], rel=1e-5)
    assert vpp["rollout/logprob_mismatch_max"] <= 1e-5


def test_moe_expert_parallel_matches_single_process(tmp_path):
    """A Qwen3-MoE-shaped tiny model with megatron's alltoall token dispatcher: EP=2 on gloo, and
    TP=2 + SP with EP=2 and expert TP=1 (experts whole, spread over the TP ranks), give the
    single-process losses and gradient norms from the same weights."""
    moe = [*FAST, "model.num_experts=4", "model.moe_ffn_hidden_size=128", "model.moe_topk=2",
           "model.moe_dispatcher=alltoall"]
    run_train(["--recipe", "tiny_sft", *moe, "train.max_steps=1", f"logging.run_dir={tmp_path / 'init'}"])
    start = [f"checkpoint.load={checkpoint_dir(tmp_path / 'init', 1)}", "checkpoint.save=false", "train.max_steps=3"]
    run_train(["--recipe", "tiny_sft", *moe, *start, f"logging.run_dir={tmp_path / 'single'}"])
    single = tmp_path / "single"
    for name, layout in (("ep2", ["parallel.ep=2"]),
                         ("tp2-sp-ep2-etp1", ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "parallel.etp=1"])):
        run_train(["--recipe", "tiny_sft", *moe, *start, *layout, f"logging.run_dir={tmp_path / name}"], nproc=2)
        assert column(tmp_path / name, "train/loss") == pytest.approx(column(single, "train/loss"), rel=1e-5), name
        assert column(tmp_path / name, "train/grad_norm") == pytest.approx(column(single, "train/grad_norm"), rel=1e-4)
