"""A GRPO step against TRL's GRPOTrainer on equal work: the same HF weights, prompts, sampling,
batch and optimizer steps, the same thread count, run alternately (never at once).

    python bench/grpo_vs_trl.py [--prompts 8] [--n 8] [--new-tokens 64] [--steps 4] [--repeats 3] [--threads 2]
    python bench/grpo_vs_trl.py --precision bf16 --trl-python python3     # a GPU (bench/gpu_check.sh)

The model is Qwen3-shaped (25.2M parameters: hidden 512, 8 layers, 8 query / 4 key-value heads,
head_dim 64, tied embeddings) over a 55-token character vocabulary, randomly initialized, so that
completions run to a random length (eos is one token in 55); prompts are 2-digit additions with an
exact-match reward; beta = 0 (no reference model); temperature 1; one optimizer step per batch.
TRL runs in its own virtual environment (bench/.trl-venv, made on first use: torch 2.13.0 on CPU,
trl 1.16.0) with num_iterations=1 (so it computes no old logprobs either), fp32, no gradient
checkpointing, no prompt truncation; its effective settings are printed.

Each side runs --steps steps per run and reports the mean of steps 2.. (the first warms up); the
sides take turns --repeats times and the ratio is the median over pairs of adjacent runs (this
shared machine's speed drifts within minutes). Printed: seconds per step, generated tokens/s, each
side's split (generation vs training; ours also the old-logprob pass, skipped with one minibatch),
the training phase's share of the GEMM rate (6 x non-embedding parameters x real tokens plus causal
attention, over the train phase's time including the optimizer step, at the oneDNN/MKL GEMM rate
measured in this run), peak RSS per phase, and the floor: the step at the GEMM rate.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / "bench" / ".trl-venv"
TRL_VERSION = "1.16.0"
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, max_position_embeddings=512)
ALPHABET = "0123456789+= abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLM"  # with <pad>, <bos>, <eos>: 55 tokens
LR = 1e-6  # TRL's default


class PhaseMeter:
    """Wall time and peak resident memory (sampled every 5 ms; on a GPU the allocator's peak) per
    named phase."""

    def __init__(self):
        self.current, self.peak, self.seconds = None, {}, {}
        self._page = os.sysconf("SC_PAGE_SIZE")
        threading.Thread(target=self._sample, daemon=True).start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self):
        while True:
            name = self.current
            if name is not None:
                self.peak[name] = max(self.peak.get(name, 0), self._rss())
            time.sleep(0.005)

    @contextmanager
    def phase(self, name: str):
        import torch

        outer, self.current = self.current, name
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                self.peak[name] = max(self.peak.get(name, 0), torch.cuda.max_memory_allocated())
            self.seconds.setdefault(name, []).append(time.perf_counter() - t0)
            self.current = outer


# --- the workload ---------------------------------------------------------------------------------

def make_workload(work: Path, prompts: int, n: int, steps: int, seed: int = 0) -> dict:
    """The HF model and tokenizer, and the prompt rows both sides read, in `work`."""
    import torch
    import transformers

    from megatron_rl.data import arithmetic
    from megatron_rl.data.tokenizer import build_char_tokenizer

    model_dir = work / "model"
    tok = build_char_tokenizer(ALPHABET, model_dir)
    assert len(tok) == 55, len(tok)
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, **SHAPE)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(str(model_dir))
    arithmetic.write_splits(work / "data", prompts * steps * 4, 8, 2, seed, 0.0)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    return {"model": str(model_dir), "train": str(work / "data" / "train.jsonl"), "params": params,
            "non_embedding_params": params - embedding}


def train_flops(non_embedding: int, lengths: list[int]) -> float:
    """Forward + backward FLOPs of training on sequences of these lengths: 6 x parameters x tokens
    plus causal attention (QK^T and PV: 2 x 2 x L^2 / 2 x heads x head_dim per layer, x 3)."""
    width = SHAPE["num_attention_heads"] * SHAPE["head_dim"]
    return 6 * non_embedding * sum(lengths) + 6 * SHAPE["num_hidden_layers"] * width * sum(n * n for n in lengths)


# --- our side (child process, this repository's environment) -----------------------------------

def run_ours(args) -> dict:
    """Our GRPO through train.py's main in this process, its phases timed by the profiler's ranges."""
    sys.path.insert(0, str(ROOT))
    import torch

    from megatron_rl.platform import profiling

    torch.set_num_threads(args.threads)
    meter = PhaseMeter()
    plain = profiling.Profiler.range

    @contextmanager
    def timed(self, name):
        with meter.phase(name), plain(self, name):
            yield

    profiling.Profiler.range = timed
    from megatron_rl.data import rl as rl_data

    plain_pack, fed = rl_data.pack, []

    def recording_pack(prompts, completions, *rest, **kw):  # what each step trains on
        fed.append(([len(p) + len(c) - 1 for p, c in zip(prompts, completions)], sum(map(len, completions))))
        return plain_pack(prompts, completions, *rest, **kw)

    rl_data.pack = recording_pack
    import train

    run_dir = Path(args.work) / f"ours_{time.time_ns()}"
    argv = ["--recipe", "tiny_grpo", f"model.hf_path={args.model}", "checkpoint.load=", "checkpoint.save=false",
            "data.task=", f"data.train_path={args.train}", "data.val_path=", "rewards.fn=exact_match",
            f"algorithm.prompts_per_step={args.prompts}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.new_tokens}",
            f"data.seq_length={args.seq_length}", f"rollout.max_sequence_length={args.seq_length + 16}",
            f"rollout.max_requests={args.prompts * args.n}", "data.micro_batch_size=16",
            f"data.max_tokens_per_microbatch={args.max_tokens}", f"optimizer.lr={LR}", f"optimizer.min_lr={LR}",
            f"train.max_steps={args.steps}", "train.eval_every=0", f"train.threads={args.threads}",
            f"train.precision={args.precision}", "logging.progress=false", "logging.tensorboard=false",
            f"logging.run_dir={run_dir}"]
    if train.main(argv) != 0:
        raise SystemExit("our GRPO run failed")
    s = meter.seconds
    steps = [{"step_s": s["rollout"][i] + s["logprob"][i] + s["train"][i], "generate_s": s["rollout"][i],
              "logprob_s": s["logprob"][i], "train_s": s["train"][i], "generated": generated, "lengths": lengths}
             for i, (lengths, generated) in enumerate(fed)]
    return {"steps": steps, "peak_bytes": {"generate": meter.peak.get("rollout", 0),
                                           "logprob": meter.peak.get("logprob", 0), "train": meter.peak.get("train", 0)}}


# --- TRL's side (child process, TRL's environment) ----------------------------------------------

def run_trl(args) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    meter = PhaseMeter()
    rows = [json.loads(line) for line in Path(args.train).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(args.model)
    # our prompts are [bos] + the prompt's characters: give TRL the same ids (it adds no special tokens)
    data = Dataset.from_list([{"prompt": tok.bos_token + r["prompt"], "answer": r["answer"]} for r in rows])
    batch = args.prompts * args.n

    def exact_match(completions, answer, **_):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    config = trl.GRPOConfig(
        output_dir=str(Path(args.work) / "trl_out"), use_cpu=not torch.cuda.is_available(),
        bf16=args.precision == "bf16", fp16=False,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=args.n,
        max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, gradient_checkpointing=False,
        max_steps=args.steps, logging_steps=1000, save_strategy="no", report_to=[], seed=0, shuffle_dataset=False,
        model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=args.model, reward_funcs=exact_match, args=config, train_dataset=data,
                              processing_class=tok)
    settings = {k: getattr(config, k) for k in ("loss_type", "scale_rewards", "num_iterations", "beta",
                                                "per_device_train_batch_size", "gradient_accumulation_steps",
                                                "steps_per_generation", "num_generations", "max_completion_length",
                                                "temperature", "top_k", "top_p", "gradient_checkpointing")}
    settings.update(trl=trl.__version__, torch=torch.__version__, threads=torch.get_num_threads(),
                    dtype=str(next(trainer.model.parameters()).dtype))
    steps, current = [], {}
    generate = trainer._generate_and_score_completions

    def timed_generate(inputs):
        with meter.phase("generate"):
            out = generate(inputs)
        current["generated"] = int(out["completion_mask"].sum())
        current["lengths"] = (out["prompt_mask"].sum(1) + out["completion_mask"].sum(1) - 1).tolist()
        return out

    trainer._generate_and_score_completions = timed_generate

    class Steps(TrainerCallback):
        def on_step_begin(self, *_, **__):
            meter.current = "train"
            current["t0"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            step = time.perf_counter() - current["t0"]
            meter.current = None
            gen = meter.seconds["generate"][-1]
            steps.append({"step_s": step, "generate_s": gen, "logprob_s": 0.0, "train_s": step - gen,
                          "generated": current["generated"], "lengths": current["lengths"]})

    trainer.add_callback(Steps())
    trainer.train()
    return {"steps": steps, "settings": settings,
            "peak_bytes": {"generate": meter.peak.get("generate", 0), "train": meter.peak.get("train", 0)}}


# --- the parent: alternate the sides, report -----------------------------------------------------

def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        print(f"making {TRL_VENV} (torch 2.13.0, trl {TRL_VERSION}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        import torch

        torch_req = "torch" if torch.cuda.is_available() else "torch==2.13.0"  # the CPU wheel, never a CUDA build
        subprocess.run([str(python), "-m", "pip", "install", "-q", torch_req], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    return python


def child(side: str, args, python: str) -> dict:
    cmd = [python, __file__, "--child", side, "--work", args.work, "--model", args.model, "--train", args.train,
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("prompts", "n", "new_tokens", "steps", "threads",
                                                                    "seq_length", "max_tokens", "precision")]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore", "MASTER_PORT": "29561",
           "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"the {side} run failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(run: dict, non_embedding: int, tflops: float) -> dict:
    steps = run["steps"][1:] or run["steps"]  # the first step warms up
    mean = {k: statistics.mean(s[k] for s in steps) for k in ("step_s", "generate_s", "logprob_s", "train_s", "generated")}
    flops = statistics.mean(train_flops(non_embedding, s["lengths"]) for s in steps)
    real = statistics.mean(sum(s["lengths"]) for s in steps)
    return {**mean, "tokens_per_s": mean["generated"] / mean["generate_s"], "train_tokens": real,
            "train_gemm_share": flops / mean["train_s"] / (tflops * 1e12), "train_floor_s": flops / (tflops * 1e12)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is not counted)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, taking turns")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=96, help="our data.seq_length (prompt + completion)")
    p.add_argument("--max-tokens", type=int, default=1024, help="our data.max_tokens_per_microbatch (0: no packing)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="both sides' training precision (bf16: mixed, fp32 master weights; for a GPU)")
    p.add_argument("--trl-python", help="a Python that imports trl (default: bench/.trl-venv, made on first use)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--ours-only", action="store_true", help="run our side only (no TRL: its time, MFU, no ratio)")
    p.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--train", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        result = run_ours(args) if args.child == "ours" else run_trl(args)
        print(json.dumps(result))
        return

    sys.path.insert(0, str(ROOT))
    from bench.rollout_throughput import matmul_tflops

    import torch

    trl_python = "" if args.ours_only else args.trl_python or str(ensure_trl_venv())
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        workload = make_workload(Path(work), args.prompts, args.n, args.steps)
        args.model, args.train = workload["model"], workload["train"]
        torch.set_num_threads(args.threads)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        tflops = matmul_tflops(device, torch.bfloat16 if args.precision == "bf16" else torch.float32)
        print(f"{workload['params'] / 1e6:.1f}M parameters ({workload['non_embedding_params'] / 1e6:.1f}M without "
              f"the embedding), {args.prompts} prompts x {args.n} samples, up to {args.new_tokens} new tokens, "
              f"{args.threads} threads; GEMM rate {tflops:.3f} TFLOP/s", flush=True)
        runs = {"ours": [], "trl": []}
        for r in range(args.repeats):
            for side in ("ours",) if args.ours_only else ("trl", "ours") if r % 2 == 0 else ("ours", "trl"):
                run = child(side, args, trl_python if side == "trl" else sys.executable)
                runs[side].append(run)
                s = summary(run, workload["non_embedding_params"], tflops)
                print(f"  run {r + 1} {side:4s}: {s['step_s']:.2f} s/step (generate {s['generate_s']:.2f}, logprob "
                      f"{s['logprob_s']:.2f}, train {s['train_s']:.2f})", flush=True)
    report(args, workload, tflops, runs)


def report(args, workload: dict, tflops: float, runs: dict):
    n_emb = workload["non_embedding_params"]
    if not runs["trl"]:  # --ours-only
        ours = [summary(r, n_emb, tflops) for r in runs["ours"]]
        print(json.dumps({k: statistics.median(s[k] for s in ours) for k in ours[0]}))
        return
    sums = {side: [summary(r, n_emb, tflops) for r in rs] for side, rs in runs.items()}
    ratios = [t["step_s"] / o["step_s"] for t, o in zip(sums["trl"], sums["ours"])]
    med = {side: {k: statistics.median(s[k] for s in ss) for k in ss[0]} for side, ss in sums.items()}
    gib = 2**30
    print(f"\nTRL settings: {json.dumps(runs['trl'][0]['settings'])}")
    print("\n| | TRL GRPOTrainer | ours |\n|---|---|---|")
    rows = [("seconds per step (median)", "step_s", "{:.2f}"), ("  generation", "generate_s", "{:.2f}"),
            ("  old-logprob pass", "logprob_s", "{:.2f}"), ("  training (fwd+bwd+optimizer)", "train_s", "{:.2f}"),
            ("generated tokens/s", "tokens_per_s", "{:.0f}"), ("real training tokens per step", "train_tokens", "{:.0f}"),
            ("training at the GEMM rate (on a GPU: MFU)", "train_gemm_share", "{:.0%}")]
    for label, key, fmt in rows:
        print(f"| {label} | {fmt.format(med['trl'][key])} | {fmt.format(med['ours'][key])} |")
    for phase in ("generate", "logprob", "train"):
        t = max((r["peak_bytes"].get(phase, 0) for r in runs["trl"]), default=0)
        o = max((r["peak_bytes"].get(phase, 0) for r in runs["ours"]), default=0)
        print(f"| peak memory, {phase} (GiB) | {t / gib:.2f} | {o / gib:.2f} |")
    ratio = statistics.median(ratios)
    print(f"\nours is {ratio:.2f}x TRL's speed (median of {len(ratios)} pairs: {', '.join(f'{x:.2f}' for x in ratios)}); "
          f"goal: 2x")
    o = med["ours"]
    floor = o["train_floor_s"] + 2 * workload["params"] * o["generated"] / (tflops * 1e12)
    print(f"floor at the GEMM rate ({tflops:.3f} TFLOP/s): training {o['train_floor_s']:.2f} s + decoding "
          f"{floor - o['train_floor_s']:.2f} s = {floor:.2f} s per step; ours takes {o['step_s'] / floor:.1f}x that "
          f"(training {o['train_s'] / o['train_floor_s']:.1f}x its floor, generation "
          f"{o['generate_s'] / max(floor - o['train_floor_s'], 1e-9):.1f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("work",)},
                                              "tflops": tflops, "workload": workload, "runs": runs, "ratios": ratios,
                                              "median": med}, indent=1))


if __name__ == "__main__":
    main()
