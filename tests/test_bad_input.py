"""Bad input ends in one sentence: each case below exits 2 with one line `error: ...` on stderr
saying what is wrong, where (file:line for data) and how to fix it; no traceback; no run directory
left behind. Cases cover overrides, data files (JSONL and parquet), tokenizers, Hugging Face
directories, checkpoints, layouts and reward functions. All run in one process
(tests/scripts/bad_inputs.py calls train.py's main on each), so start-up is paid once."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_rl.checkpointing import MARKER, checkpoint_dir
from tests.helpers import ROOT, launch_env, run_train
from tests.hf_models import make_tokenizer, save_tiny_model

QUIET = ["train.max_steps=1", "train.eval_every=0", "logging.progress=false", "logging.tensorboard=false"]
GOOD = {"prompt": "1+1=", "response": "2"}


def _files(d):
    """The data, tokenizer, model and checkpoint files the cases point at."""
    def jsonl(name, rows):
        (d / name).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
        return str(d / name)

    f = {"good": jsonl("good.jsonl", [GOOD] * 4),
         "bad_json": jsonl("bad_json.jsonl", [GOOD, '{"prompt": "1+1=", "response": "2"']),
         "missing": jsonl("missing.jsonl", [GOOD, {"prompt": "1+2="}]),
         "number": jsonl("number.jsonl", [GOOD, {"prompt": "1+1=", "response": 2}]),
         "list_prompt": jsonl("list_prompt.jsonl", [{"prompt": ["1+1="], "response": "2"}]),
         "not_object": jsonl("not_object.jsonl", [GOOD, "[1, 2]"]),
         "empty": jsonl("empty.jsonl", []),
         "long": jsonl("long.jsonl", [GOOD, {"prompt": "1+1=" * 40, "response": "2"}]),
         "messages": jsonl("messages.jsonl", [{"messages": [{"role": "user", "content": "1+1="}]}]),
         "rl_no_prompt": jsonl("rl_no_prompt.jsonl", [{"question": "1+1=", "answer": "2"}]),
         "rl_long": jsonl("rl_long.jsonl", [{"prompt": "1+1=" * 40, "answer": "2"}] * 4),
         "dir": str(d)}
    (d / "latin1.jsonl").write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"prompt": "é", "response": "2"}\n'.encode("latin-1"))
    f["latin1"] = str(d / "latin1.jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "response": 2}, {"prompt": "1+2=", "response": 3}]), d / "number.parquet")
    pq.write_table(pa.Table.from_pylist([GOOD] * 4), d / "good.parquet")
    (d / "junk.parquet").write_bytes(b"not parquet at all")
    f.update(number_parquet=str(d / "number.parquet"), good_parquet=str(d / "good.parquet"),
             junk_parquet=str(d / "junk.parquet"))

    tok = make_tokenizer(d / "tok")
    f["tok"] = str(d / "tok")
    (d / "empty_dir").mkdir()
    f["empty_dir"] = str(d / "empty_dir")
    shutil.copytree(d / "tok", d / "tok_no_eos")
    config = json.loads((d / "tok_no_eos" / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (d / "tok_no_eos" / "tokenizer_config.json").write_text(json.dumps(config))
    f["tok_no_eos"] = str(d / "tok_no_eos")
    del tok

    hf = save_tiny_model("llama", d / "hf")
    for name, damage in {"no_config": lambda p: (p / "config.json").unlink(),
                         "unsupported": lambda p: (p / "config.json").write_text(json.dumps(
                             {**json.loads((p / "config.json").read_text()), "architectures": ["GPT2LMHeadModel"],
                              "model_type": "gpt2"})),
                         "missing_shard": _missing_shard,
                         "wrong_shape": _wrong_shape,
                         "pickled": _pickled}.items():
        shutil.copytree(hf, d / name)
        damage(d / name)
        f[name] = str(d / name)
    f["hf"] = str(hf)

    run = d / "run"
    run_train(["--recipe", "tiny_sft", *QUIET, "train.max_steps=2", "checkpoint.save_every=1", "checkpoint.keep=0",
               f"logging.run_dir={run}"])
    f["run"], f["ckpt"] = str(run), str(checkpoint_dir(run, 2))
    shutil.copytree(run, d / "run_incomplete")
    (checkpoint_dir(d / "run_incomplete", 2) / MARKER).unlink()
    (checkpoint_dir(d / "run_incomplete", 1) / MARKER).unlink()
    f["ckpt_incomplete"] = str(checkpoint_dir(d / "run_incomplete", 2))
    shutil.copytree(run, d / "run_truncated")
    shard = max(checkpoint_dir(d / "run_truncated", 2).glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:50])
    f["ckpt_truncated"] = str(checkpoint_dir(d / "run_truncated", 2))
    (d / "badreward.py").write_text("import not_a_module_anywhere\n")
    (d / "rewards_ok.py").write_text("LIMIT = 3\n\ndef two_args(prompt, completion):\n    return 0.0\n")
    return f


def _missing_shard(p):
    """A two-shard checkpoint whose second shard is gone."""
    from safetensors import safe_open

    with safe_open(str(p / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    (p / "model.safetensors").rename(p / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map[names[-1]] = "model-00002-of-00002.safetensors"
    (p / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _wrong_shape(p):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(p / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:, :-1].contiguous()
    save_file(weights, str(p / "model.safetensors"), metadata={"format": "pt"})


def _pickled(p):
    from safetensors.torch import load_file

    torch.save(load_file(str(p / "model.safetensors")), p / "pytorch_model.bin")
    (p / "model.safetensors").unlink()


def _sft(f, data, *extra):
    return ["--recipe", "tiny_sft", *QUIET, "data.task=", f"data.train_path={f[data]}", f"data.tokenizer={f['tok']}",
            *extra]


def _grpo(f, data, *extra):
    return ["--recipe", "tiny_grpo", *QUIET, "checkpoint.load=", "data.task=", f"data.train_path={f[data]}",
            f"data.tokenizer={f['tok']}", *extra]


def _distill(f):
    return ["--recipe", "tiny_distill", *QUIET, f"checkpoint.load={f['ckpt']}", f"distill.teacher={f['ckpt']}"]


def _hf(f, name):
    return ["--recipe", "tiny_sft", *QUIET, f"model.hf_path={f[name]}", "data.task=", f"data.train_path={f['good']}"]


# name -> (arguments given the files, a fragment the one sentence must contain)
CASES = {
    # recipes and overrides
    "unknown recipe": (lambda f: ["--recipe", "tiny_nope"], "unknown recipe"),
    "unknown key": (lambda f: ["--recipe", "tiny_sft", "train.max_step=3"], "train.max_steps"),
    "unknown section": (lambda f: ["--recipe", "tiny_sft", "trian.max_steps=3"], "train"),
    "no equals sign": (lambda f: ["--recipe", "tiny_sft", "train.max_steps"], "section.field=value"),
    "not an integer": (lambda f: ["--recipe", "tiny_sft", "train.max_steps=many"], "train.max_steps"),
    "not a choice": (lambda f: ["--recipe", "tiny_sft", "checkpoint.resume=maybe"], "checkpoint.resume"),
    "negative steps": (lambda f: ["--recipe", "tiny_sft", "checkpoint.save_every=-1"], "must be >= 0"),
    "unknown task": (lambda f: ["--recipe", "tiny_sft", "data.task=poetry"], "unknown data.task"),
    "unknown algorithm": (lambda f: ["--recipe", "tiny_sft", "algorithm.name=trpo"], "algorithm.name"),
    "unknown optimizer": (lambda f: ["--recipe", "tiny_sft", "optimizer.name=lion"], "optimizer.name"),
    "Muon option out of range": (lambda f: ["--recipe", "tiny_sft_muon", "optimizer.muon_ns_steps=100"],
                                 "optimizer.muon_ns_steps=100 is out of range"),
    # data files
    "no such data file": (lambda f: _sft(f, "good", f"data.train_path={f['dir']}/nope.jsonl"), "does not exist"),
    "a directory": (lambda f: _sft(f, "dir"), "is a directory"),
    "malformed JSON": (lambda f: _sft(f, "bad_json"), "bad_json.jsonl:2: not valid JSON"),
    "missing field": (lambda f: _sft(f, "missing"), "missing.jsonl:2: a row needs 'prompt' and 'response'"),
    "response a number": (lambda f: _sft(f, "number"), "number.jsonl:2: 'response' must be a string"),
    "prompt a list": (lambda f: _sft(f, "list_prompt"), "list_prompt.jsonl:1: 'prompt' must be a string"),
    "row not an object": (lambda f: _sft(f, "not_object"), "not_object.jsonl:2: a row must be a JSON object"),
    "empty file": (lambda f: _sft(f, "empty"), "has no rows"),
    "non-UTF-8 bytes": (lambda f: _sft(f, "latin1"), "latin1.jsonl:2: not UTF-8 text"),
    "longer than seq_length": (lambda f: _sft(f, "long"), "long.jsonl:2: 163 tokens exceed data.seq_length=16"),
    "messages without an answer": (lambda f: _sft(f, "messages"), "messages.jsonl:1: the last message must have role"),
    "parquet, mistyped": (lambda f: _sft(f, "number_parquet"), "number.parquet:1: 'response' must be a string"),
    "parquet, unreadable": (lambda f: _sft(f, "junk_parquet"), "junk.parquet: not a readable parquet file"),
    "validation file missing": (lambda f: _sft(f, "good", f"data.val_path={f['dir']}/nope.jsonl"), "does not exist"),
    "RL row without a prompt": (lambda f: _grpo(f, "rl_no_prompt"), "rl_no_prompt.jsonl:1: an RL row needs a 'prompt'"),
    "RL prompt too long": (lambda f: _grpo(f, "rl_long"), "rl_long.jsonl:1: the prompt's 161 tokens leave no room"),
    # tokenizers
    "no tokenizer": (lambda f: ["--recipe", "tiny_sft", *QUIET, "data.task=", f"data.train_path={f['good']}"],
                     "needs the model's tokenizer"),
    "tokenizer directory missing": (lambda f: _sft(f, "good", f"data.tokenizer={f['dir']}/nope"), "does not exist"),
    "not a tokenizer": (lambda f: _sft(f, "good", f"data.tokenizer={f['empty_dir']}"), "is not a tokenizer"),
    "tokenizer without eos": (lambda f: _sft(f, "good", f"data.tokenizer={f['tok_no_eos']}"), "no end-of-sequence"),
    "pad token not in vocabulary": (lambda f: _sft(f, "good", "data.pad_token=<nope>"), "data.pad_token"),
    # Hugging Face directories
    "HF directory missing": (lambda f: [*_hf(f, "hf")[:-3], f"model.hf_path={f['dir']}/nope"], "does not exist"),
    "HF without config.json": (lambda f: _hf(f, "no_config"), "config.json"),
    "HF unsupported architecture": (lambda f: _hf(f, "unsupported"), "unsupported Hugging Face architecture"),
    "HF shard missing": (lambda f: _hf(f, "missing_shard"), "model-00002-of-00002.safetensors"),
    "HF tensor of the wrong shape": (lambda f: _hf(f, "wrong_shape"), "model.embed_tokens.weight"),
    "HF pickled weights": (lambda f: _hf(f, "pickled"), "pickled"),
    # checkpoints
    "checkpoint missing": (lambda f: ["--recipe", "tiny_sft", *QUIET, f"checkpoint.load={f['dir']}/nope"],
                           "does not exist"),
    "checkpoint incomplete": (lambda f: ["--recipe", "tiny_sft", *QUIET, f"checkpoint.load={f['ckpt_incomplete']}"],
                              "not a complete megatron-rl checkpoint"),
    "checkpoint of another architecture": (
        lambda f: ["--recipe", "tiny_sft", *QUIET, f"checkpoint.load={f['ckpt']}", "model.num_layers=3"],
        "holds a different model: model.num_layers=2"),
    "checkpoint of another optimizer type": (
        lambda f: ["--recipe", "tiny_sft", *QUIET, "train.max_steps=3", "checkpoint.resume=true",
                   "optimizer.distributed=true", f"logging.run_dir={f['run']}"], "optimizer.distributed=false"),
    "checkpoint with a truncated file": (
        lambda f: ["--recipe", "tiny_sft", *QUIET, f"checkpoint.load={f['ckpt_truncated']}"], "is damaged"),
    "resume without a checkpoint": (lambda f: ["--recipe", "tiny_sft", *QUIET, "checkpoint.resume=true"],
                                    "no complete checkpoint"),
    # layouts
    "TP larger than the world": (lambda f: ["--recipe", "tiny_sft", "parallel.tp=2"], "world size"),
    "EP not dividing the experts": (lambda f: ["--recipe", "tiny_moe_sft", "parallel.ep=3"], "parallel.ep"),
    # disaggregated and asynchronous RL (a printed recipe is checked against its own world: tp x pp x cp x dp + rollout_ranks)
    "generation ranks leave no trainer": (lambda f: ["--recipe", "tiny_grpo", *QUIET, "parallel.rollout_ranks=1"],
                                          "leaves no training rank in a job of 1 rank(s)"),
    "generation layout not dividing its ranks": (lambda f: ["--recipe", "tiny_grpo", "parallel.rollout_ranks=3",
                                                            "parallel.rollout_tp=2", "--print-config"],
                                                 "the generation ranks' layout (parallel.rollout_tp=2"),
    "top-k over the whole vocabulary": (lambda f: ["--recipe", "tiny_grpo", *QUIET, "rollout.top_k=15"],
                                        "rollout.top_k=15 keeps every token of the vocabulary"),
    "negative top-k": (lambda f: ["--recipe", "tiny_grpo", *QUIET, "rollout.top_k=-1"], "rollout.top_k=-1 must be >= 0"),
    "allgather dispatcher for expert-parallel rollouts": (
        lambda f: ["--recipe", "tiny_moe_grpo", "parallel.ep=2", "parallel.dp=2", "model.moe_dispatcher=allgather",
                   "--print-config"],
        "model.moe_dispatcher=allgather cannot roll out at expert parallelism"),
    "negative staleness": (lambda f: ["--recipe", "tiny_grpo", *QUIET, "algorithm.max_staleness=-1"],
                           "algorithm.max_staleness=-1 must be >= 0"),
    "staleness without generation ranks": (lambda f: ["--recipe", "tiny_grpo", *QUIET, "algorithm.max_staleness=1"],
                                           "needs generation ranks"),
    "staleness without a correction": (lambda f: ["--recipe", "tiny_grpo_async", "algorithm.off_policy=none",
                                                  "--print-config"], "without a correction biases the gradient"),
    "more generation copies than training replicas": (lambda f: ["--recipe", "tiny_grpo", "parallel.rollout_ranks=2",
                                                                 "--print-config"], "must divide the training ranks' 1"),
    "generation ranks for DPO": (lambda f: ["--recipe", "tiny_dpo", "parallel.rollout_ranks=1", "--print-config"],
                                 "algorithm.name=dpo does not (only grpo and ppo do)"),
    # distillation
    "distill without a teacher": (lambda f: [*_distill(f), "distill.teacher="], "needs a teacher"),
    "distill top-k below 1": (lambda f: [*_distill(f), "distill.topk=0"], "distill.topk=0 must be at least 1"),
    "distill top-k above the vocabulary": (lambda f: [*_distill(f), "distill.topk=99"], "exceeds the vocabulary"),
    "teacher missing": (lambda f: [*_distill(f), f"distill.teacher={f['dir']}/nope"], "does not exist"),
    "teacher of another tokenizer": (lambda f: [*_distill(f), f"distill.teacher={f['hf']}"], "another tokenizer"),
    "cross-tokenizer with several teachers": (lambda f: ["--recipe", "tiny_mopd", *QUIET, "distill.cross_tokenizer=true"],
                                              "distill.cross_tokenizer=true takes one teacher"),
    # PPO
    "critic of another architecture": (lambda f: ["--recipe", "tiny_ppo", *QUIET, f"checkpoint.load={f['ckpt']}",
                                                  f"ppo.critic={f['hf']}"], "holds a model of another architecture than the policy"),
    "critic missing": (lambda f: ["--recipe", "tiny_ppo", *QUIET, f"checkpoint.load={f['ckpt']}",
                                  f"ppo.critic={f['dir']}/nope"], "ppo.critic="),
    "row naming a teacher not given": (lambda f: ["--recipe", "tiny_mopd", *QUIET, f"distill.teachers=add:{f['ckpt']}"],
                                       "names teacher 'sub', which distill.teachers does not have (add)"),
    "unknown arithmetic operation": (lambda f: ["--recipe", "tiny_sft", "data.ops=/"], "data.ops='/' must be"),
    "chat observations without a chat template": (
        lambda f: _grpo(f, "good", "rewards.fn=sliding_puzzle", "rollout.observation_format=chat"),
        "rollout.observation_format=chat needs a tokenizer with a chat template"),
    # reward functions
    "reward not module:function": (lambda f: _grpo(f, "good", "rewards.fn=closeness"), "module:function"),
    "reward import error": (lambda f: _grpo(f, "good", "rewards.fn=badreward:score"), "cannot be loaded"),
    "reward not callable": (lambda f: _grpo(f, "good", "rewards.fn=rewards_ok:LIMIT"), "is not callable"),
    "reward of the wrong signature": (lambda f: _grpo(f, "good", "rewards.fn=rewards_ok:two_args"),
                                      "(prompt, completion, metadata)"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_input")
    f = _files(d)
    cases = {name: [*make(f), f"logging.run_dir={d / 'runs' / str(i)}"] if not any(
        a.startswith("logging.run_dir=") for a in make(f)) else make(f) for i, (name, (make, _)) in enumerate(CASES.items())}
    env = {**launch_env(), "PYTHONPATH": str(d)}  # the reward modules
    proc = subprocess.run([sys.executable, "tests/scripts/bad_inputs.py", json.dumps(list(cases.values()))], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return d, dict(zip(cases, results))


def test_there_are_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_sentence(outcomes, name):
    d, results = outcomes
    out = results[name]
    assert not out["traceback"], out["traceback"][-3000:]
    lines = [line for line in out["stderr"].splitlines() if line.strip()]
    assert out["code"] == 2 and len(lines) == 1 and lines[0].startswith("error: "), out
    assert CASES[name][1] in lines[0], lines[0]
    run_dir = next((a.split("=", 1)[1] for a in out["argv"] if a.startswith("logging.run_dir=")), None)
    if run_dir and str(d / "runs") in run_dir:
        assert not (d / "runs" / run_dir.rsplit("/", 1)[1]).exists()  # nothing half-written


def test_bad_rows_can_be_skipped(outcomes, tmp_path):
    """data.on_bad_row=skip drops malformed, mistyped, non-UTF-8 and over-long rows, trains on the
    rest, and says how many it dropped and where the first few were."""
    d, _ = outcomes
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b"".join([json.dumps(GOOD).encode() + b"\n"] * 3 + [
        b'{"prompt": "1+1=", "response": 2}\n', b"{not json\n", '{"prompt": "\xe9"}\n'.encode("latin-1"),
        json.dumps({"prompt": "1+1=" * 40, "response": "2"}).encode() + b"\n", json.dumps(GOOD).encode() + b"\n"]))
    proc = run_train(["--recipe", "tiny_sft", *QUIET, "data.task=", f"data.train_path={mixed}", f"data.tokenizer={d / 'tok'}",
                      "data.on_bad_row=skip", "data.global_batch_size=4", "data.micro_batch_size=4",
                      f"logging.run_dir={tmp_path / 'run'}"])
    assert f"data.on_bad_row=skip: dropped 4 bad row(s) of {mixed}: {mixed}:5: not valid JSON" in proc.stdout
    assert f"{mixed}:6: not UTF-8 text" in proc.stdout and f"{mixed}:4: 'response' must be a string" in proc.stdout


def test_a_refused_resume_leaves_the_run_directory_as_it_was(outcomes):
    """The case 'checkpoint of another optimizer type' resumed an existing run and was refused: its
    config.json and metrics.jsonl are as the run left them (written only once everything loaded)."""
    d, results = outcomes
    assert results["checkpoint of another optimizer type"]["code"] == 2
    assert json.loads((d / "run" / "config.json").read_text())["optimizer"]["distributed"] is False
    assert [json.loads(line)["step"] for line in (d / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
