"""Run train.py as a user would: a subprocess, under torchrun for several ranks (gloo, real processes)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from megatron_rl.platform import device, free_port  # noqa: F401 (tests import free_port from here)

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


FP32_BOUNDS = False  # the running test is marked fp32 (conftest.py)


def fp32_on_cuda(args: list[str]) -> list[str]:
    """train.py arguments, with train.precision=fp32 where CUDA runs and the test's bounds are fp32
    bounds (marked fp32), unless they choose a precision themselves."""
    import torch

    if FP32_BOUNDS and torch.cuda.is_available() and not any(a.startswith("train.precision=") for a in args):
        return [*args, "train.precision=fp32"]
    return args


def run_train(args: list[str], nproc: int = 1, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    args = fp32_on_cuda(args)
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
    runs = [fp32_on_cuda(run) for run in runs]
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
                t = torch.tensor([prompt + completion], device=device())
                logits = chunk(t, torch.arange(t.shape[1], device=t.device)[None], None)[0, len(prompt) - 1:-1, :vocab]
                logits = logits.float().cpu()
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            worst = max(worst, (torch.tensor(logprobs) - expected).abs().max().item())
    return worst


def random_char_engine(tmp_path, max_new_tokens: int, stop: tuple = (), seq_length: int = 32,
                       alphabet: str = "0123456789+=", precision: str = "fp32"):
    """A random model over the characters of sums (init std 0.5: it samples widely) and the rollout
    engine on it, in this process (needs the one_process fixture): (tokenizer, model chunks, engine).
    seq_length: the training length (data.seq_length) the rollout's attention agrees with;
    precision: train.precision (fp32, bf16) of the model and the engine."""
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
    cfg.train.precision = precision
    chunks, _ = build_model(cfg, wrap_ddp=False)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return tok, chunks, RolloutEngine(chunks, cfg.model, tok, cfg.rollout, dtype)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [3, 3, 3, 3, 3, 3, 3]]  # of random_char_engine's tokens


def bf16_trainee(packed: bool):
    """A bf16 trainee of a tiny model (in this process: one_process) and microbatches of 8 random
    samples of 5 to 26 tokens: rows of 32, or packed under 64 tokens."""
    import torch

    from megatron_rl.config import Config
    from megatron_rl.training.setup import build_trainee
    from megatron_rl.training.step import make_microbatches

    cfg = Config()
    cfg.model.vocab_size, cfg.data.seq_length, cfg.train.precision = 32, 32, "bf16"
    cfg.data.max_tokens_per_microbatch = 64 if packed else 0
    trainee = build_trainee(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (8, 32), generator=g)
    mask = (torch.arange(32)[None] < torch.arange(5, 29, 3)[:, None]).float()  # samples of 5..26 tokens
    micro = make_microbatches(cfg, {"tokens": tokens, "loss_mask": mask, "index": torch.arange(8)}, 4)
    return trainee, micro


def microbatch_forward(trainee, mb):
    """One microbatch through the first model chunk as the training step feeds it: its inputs made now,
    and a function that runs the forward -> logits (b, s, V)."""
    from megatron_rl.training import step

    host = step.cp_share(mb)
    batch = {k: v.to(device()) for k, v in host.items()}
    if "pack_cu" in host:
        inputs = step._packed_inputs(host)  # on the host, before the forward
        return lambda: step._packed_forward(trainee.model[0], batch, inputs)
    return lambda: trainee.model[0](batch["tokens"], batch["positions"][None].expand_as(batch["tokens"]), None)


def loss_fn(mb, logits):
    """A per-token loss as training/step.py wants one: (sum, token count, report)."""
    loss = -(logits.float().log_softmax(-1)[..., 0] * mb["loss_mask"]).sum()
    return loss, mb["loss_mask"].sum().long(), {"loss_sum": loss.detach(), "tokens": mb["loss_mask"].sum()}
