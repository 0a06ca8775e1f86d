"""Every command the README and the docs show runs here, so a documented command cannot break unseen.

train.py's and the tools' commands run in the order of PAGES in one directory, as a reader's would (each
starts from what the ones before it wrote: tiny_grpo from tiny_sft's run, tiny_grpo_rm from tiny_rm's),
training shortened to 2 steps on small splits, with stand-ins for the README's placeholders (HF_DIR: a
tiny Hugging Face Llama; data files written from the arithmetic task; /path/to/hf/Qwen3-8B: the teacher
trained just before). Where a command cannot run on a 2-core laptop, what can be is checked: a recipe
for a GPU cluster resolves and validates for its own layout as train.py checks it, a torchrun layout for
its world size (the layouts themselves run in test_sft.py and test_eval.py), make's targets dry-run,
Slurm scripts parse, and the Dockerfile is linted (test_container.py; there is no Docker daemon).
"""

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import ROOT, launch_env

LAUNCHERS = ("python", "torchrun", "srun", "make", "sbatch", "docker")
SHORT = ["train.max_steps=2", "train.eval_every=0", "data.num_train=256", "data.num_val=16",
         "logging.progress=false", "logging.tensorboard=false"]
SHORT_HF = ["data.seq_length=64", "data.global_batch_size=16", "rollout.max_new_tokens=8",
            "algorithm.prompts_per_step=8"]  # a random stand-in model writes to the length limit
SHORT_EVAL = ["--max-new-tokens", "8"]
CLUSTER = ("llama32_1b_grpo", "qwen25_32b_grpo")  # bf16, 4k-token sequences: checked, not run


PAGES = ["README.md", "docs/getting-started.md", "docs/cluster.md", "docs/algorithms/sft.md", "docs/algorithms/grpo.md",
         "docs/algorithms/ppo.md", "docs/algorithms/dpo.md", "docs/algorithms/reward-models.md",
         "docs/algorithms/distillation.md", "docs/lora.md", "docs/environments.md", "docs/evaluation.md",
         "docs/models.md", "docs/reliability.md", "docs/parallelism.md", "docs/platform.md", "docs/architecture.md",
         "docs/testing.md", "docs/configuration.md"]
"""The README, then the docs in the order a reader following the README's table would meet their
commands (each may start from what an earlier one wrote: tiny_grpo from tiny_sft's run)."""


def documented_commands() -> list[str]:
    """The command lines of the README and the docs (4-space code blocks starting with a launcher, after
    any VAR=value settings), continuation lines joined, '&&' chains split, comments and optional [...]
    parts dropped, in order; a command a page repeats runs once."""
    commands = []
    text = re.sub(r"\\\n\s*", " ", "\n".join((ROOT / page).read_text() for page in PAGES))
    for line in text.splitlines():
        words = [w for w in line.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]
        if line.startswith("    ") and words and words[0] in LAUNCHERS:
            line = re.sub(r"\[[^\]]*\]", "", " ".join(words).split(" # ")[0])
            commands += [c.strip() for c in line.split("&&") if c.strip() not in commands]  # each once
    return commands


def standins(tmp_path) -> dict[str, str]:
    """The README's placeholders, and files and models made for them."""
    from tests.hf_models import save_tiny_model

    long = {"max_position_embeddings": 8192}  # the recipes' lengths, as real models take
    llama = save_tiny_model("llama", tmp_path / "hf_llama", **long)
    qwen = save_tiny_model("qwen3", tmp_path / "hf_qwen3", **long)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 30) for b in range(40, 44)]
    files = {"sft.jsonl": [{**r, "response": r["answer"]} for r in rows],
             "math.jsonl": rows,
             "gsm8k.jsonl": rows,
             "pairs.jsonl": [{**r, "chosen": r["answer"], "rejected": str(int(r["answer"]) + 1)} for r in rows],
             "test.jsonl": rows}
    files["val.jsonl"] = files["pairs.jsonl"][:16]
    for name, content in files.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in content))
    import pyarrow.json

    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.json.read_json(tmp_path / "test.jsonl"), tmp_path / "test.parquet")
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "rewards.py").write_text(
        "def score(prompt, completion, metadata):\n    return float(completion.strip() == metadata['answer'])\n")
    from tests.test_recipes import LLAMA32_1B, QWEN25_32B

    published = {}  # a cluster recipe's checkpoint: its published config.json (checked, not run)
    for name, config in (("/ckpt/Llama-3.2-1B-Instruct", LLAMA32_1B), ("/ckpt/Qwen2.5-32B-Instruct", QWEN25_32B)):
        published[name] = tmp_path / name.rsplit("/", 1)[1]
        published[name].mkdir()
        (published[name] / "config.json").write_text(json.dumps(config))
    return {"HF_DIR": str(llama), "/models/Llama-3.2-1B": str(llama), "/models/Qwen3-0.6B": str(qwen),
            **{name: str(path) for name, path in published.items()},
            "/path/to/hf/Qwen3-8B": "runs/tiny_teacher", "TOK": "runs/tiny_sft/hf_assets",
            "MEGATRON_DIR": "imported", "RUN": "runs/tiny_grpo", "FILE": "runs/tiny_grpo/data/val.jsonl",
            "NAME": "tiny_sft", "RECIPE": "tiny_sft"}


def substituted(tokens: list[str], table: dict[str, str], serial: int) -> list[str]:
    out = []
    for i, token in enumerate(tokens):
        if i and tokens[i - 1] == "--out" and token == "HF_DIR":  # each export writes a fresh directory
            out.append(f"out{serial}")
            continue
        key, eq, value = token.rpartition("=")
        out.append(f"{key}{eq}{table.get(value, value)}")
    return out


def plan_of(commands: list[str], table: dict[str, str]):
    """What the test does with each command: ('run', argv) in the shared directory, ('check', argv,
    world size) through train.py's own checks, ('make', target), ('script', path), ('lint', reason)."""
    plan = []
    for serial, command in enumerate(commands):
        tokens = substituted(shlex.split(command), table, serial)
        launcher = tokens[0]
        if launcher == "make":
            plan.append(("make", tokens[1]))
        elif launcher == "sbatch":
            plan.append(("script", next(t for t in tokens if t.endswith(".sbatch"))))
        elif launcher == "docker":
            plan.append(("lint", "no Docker daemon here: the Dockerfile is linted by test_container.py"))
        else:
            world = 1
            if launcher == "srun":
                tokens = tokens[1:]
            if tokens[0] == "torchrun":
                world, tokens = int(tokens[2]), ["python", *tokens[3:]]
            script, argv = tokens[1], tokens[2:]
            if script == "tools/plan.py":
                plan.append(("plan", argv))
            elif script == "train.py" and (world > 1 or any(name in argv for name in CLUSTER)):
                plan.append(("check", argv, world))
            elif world > 1:  # a tool under torchrun: the same command in one process, its layout dropped
                plan.append(("run", [script, *re.sub(r"--(tp|pp|ep) \d+ ?", "", " ".join(argv)).split(),
                                     *SHORT_EVAL * (script == "tools/eval.py")]))
            else:
                trains = script == "train.py" and "--recipe" in argv and "--print-config" not in argv
                hf = trains and argv[argv.index("--recipe") + 1].startswith("hf_")
                extra = (SHORT + SHORT_HF * hf) if trains else SHORT_EVAL if script == "tools/eval.py" else []
                plan.append(("run", [script, *argv, *extra]))
    return plan


def check(argv: list[str], world: int, monkeypatch, capsys):
    """A train.py command that cannot run here, checked as far as it can be: train.py's own validation for
    the launch's world size (as --print-config does on that launch), and the keys its recipe needs."""
    import train
    from recipes import check_needs

    for var, value in {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "localhost",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(var, value)
    assert train.main([*argv, "--print-config"]) == 0, capsys.readouterr().err
    from megatron_rl.config import apply_overrides
    from recipes import get_recipe

    args = train.parse_args(argv)
    check_needs(apply_overrides(get_recipe(args.recipe), args.overrides))


def test_every_documented_command_runs(tmp_path, monkeypatch, capsys):
    commands = documented_commands()
    assert len(commands) > 40 and commands[:2] == ["make demo", "make test"]
    table = standins(tmp_path)
    runs, plans = [], []
    for step in plan_of(commands, table):
        kind = step[0]
        if kind == "make":
            proc = subprocess.run(["make", "-n", step[1]], cwd=ROOT, capture_output=True, text=True)
            assert proc.returncode == 0, (step, proc.stderr)
        elif kind == "script":
            assert subprocess.run(["bash", "-n", str(ROOT / step[1])]).returncode == 0, step
        elif kind == "plan":
            plans.append(step[1])
        elif kind == "check":
            check(*step[1:], monkeypatch, capsys)
        elif kind == "run":
            runs.append(step[1])
    monkeypatch.undo()
    env = launch_env()
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "run_commands.py"), json.dumps(runs)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads(proc.stdout.rsplit("RESULTS ", 1)[1])
    failed = [r for r in results if r["code"]]
    assert not failed, (failed, proc.stdout[-3000:], proc.stderr[-5000:])
    assert len(results) == len(runs)
    print(*(f"{r['seconds']:6.1f} s  {' '.join(r['command'][:3])}" for r in results), sep="\n")
    for argv in plans:
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("line, expected", [
    ("    python train.py --recipe tiny_sft  # trains", ["python train.py --recipe tiny_sft"]),
    ("    python a.py && python b.py x=[1]", ["python a.py", "python b.py x="]),
    ("    sbatch slurm/single_node.sbatch RECIPE [section.field=value ...]       # 1 node",
     ["sbatch slurm/single_node.sbatch RECIPE"]),
    ("    IMAGE=/x.sqsh MOUNTS=/a:/a \\\n        sbatch --nodes=4 slurm/multi_node.sbatch RECIPE [...]   # pyxis",
     ["sbatch --nodes=4 slurm/multi_node.sbatch RECIPE"]),
])
def test_commands_are_read_from_code_lines(line, expected, monkeypatch, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"text python train.py\n\n{line}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PAGES", ["README.md"])
    assert documented_commands() == expected
