"""Run train.py as a user would: a subprocess, under torchrun for several ranks (gloo, real processes)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from megatron_rl.platform import free_port  # noqa: F401 (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]


def threads(nproc: int = 1) -> str:
    """OMP_NUM_THREADS for each of nproc processes: this pytest worker's share of the cores (make
    test runs two workers on two cores), so that runs never oversubscribe them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return str(max(1, len(os.sched_getaffinity(0)) // workers // nproc))


def torchrun(nproc: int) -> list[str]:
    """torchrun on this machine with nproc workers; --standalone lets it choose a free port itself
    (a port picked here beforehand can be taken by a concurrent test before torchrun binds it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def launch_env(nproc: int = 1) -> dict:
    """This environment without any launcher's variables, with this worker's share of the threads."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": threads(nproc)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_train(args: list[str], nproc: int = 1, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = launch_env(nproc)
    cmd = [sys.executable, "train.py", *args] if nproc == 1 else [*torchrun(nproc), "train.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_tool(script: str, args: list[str], nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """tools/<script> with args, as a user runs it (under torchrun for several ranks); not checked."""
    cmd = [*(torchrun(nproc) if nproc > 1 else [sys.executable]), f"tools/{script}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(nproc), capture_output=True, text=True, timeout=timeout)


def run_recipes(runs: list[list[str]], nproc: int = 1, timeout: int = 900) -> subprocess.CompletedProcess:
    """Several train.py argument lists run one after another in one process group
    (tests/scripts/run_recipes.py): start-up and imports are paid once."""
    script = str(ROOT / "tests" / "scripts" / "run_recipes.py")
    env = launch_env(nproc)
    cmd = ([sys.executable] if nproc == 1 else torchrun(nproc)) + [script, json.dumps(runs)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def processes(layout: list[str]) -> int:
    """The world size a layout of parallel.{tp,pp,cp,dp}=N overrides needs."""
    return math.prod(int(o.split("=")[1]) for o in layout
                     if o.split("=")[0] in ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp"))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def column(run_dir: Path, key: str) -> list[float]:
    return [row[key] for row in metrics(run_dir) if key in row]


def worst_logprob_mismatch(engine, chunk, prompts: list[list[int]], seeds, vocab: int) -> float:
    """The largest difference between a sampled token's rollout logprob and the training forward's
    (one full forward of prompt + completion) over the rollouts of `prompts` with each seed."""
    import torch

    worst = 0.0
    for seed in seeds:
        out = engine.generate(prompts, seed=seed)
        for prompt, completion, logprobs in zip(prompts, out.completions, out.logprobs):
            with torch.no_grad():
                t = torch.tensor([prompt + completion])
                logits = chunk(t, torch.arange(t.shape[1])[None], None)[0, len(prompt) - 1:-1, :vocab]
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            worst = max(worst, (torch.tensor(logprobs) - expected).abs().max().item())
    return worst


def random_char_engine(tmp_path, max_new_tokens: int, stop: tuple = (), seq_length: int = 32,
                       alphabet: str = "0123456789+="):
    """A random model over the characters of sums (init std 0.5: it samples widely) and the rollout
    engine on it, in this process (needs the one_process fixture): (tokenizer, model chunks, engine).
    seq_length: the training length (data.seq_length) the rollout's attention agrees with."""
    import torch

    from megatron_rl.config import Config
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.training.setup import build_model

    tok = build_char_tokenizer(alphabet, tmp_path / "tok")
    cfg = Config()
    cfg.model.vocab_size = len(tok)
    cfg.model.init_method_std = 0.5
    cfg.rollout.max_new_tokens = max_new_tokens
    cfg.rollout.stop = list(stop)
    cfg.data.seq_length = seq_length
    chunks, _ = build_model(cfg, wrap_ddp=False)
    return tok, chunks, RolloutEngine(chunks, cfg.model, tok, cfg.rollout, torch.float32)
