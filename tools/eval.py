"""Evaluate a checkpoint the way results are reported: greedy accuracy, pass@k and maj@k.

    python tools/eval.py --checkpoint runs/tiny_grpo --data runs/tiny_grpo/data/val.jsonl
    python tools/eval.py --hf HF_DIR --data test.parquet --n 16 --k 1,4,16 --temperature 0.7 --out results.json
    torchrun --nproc_per_node 4 tools/eval.py --checkpoint RUN --data FILE --tp 2 --num-samples 16

Rows are JSON objects (JSONL or parquet) with a 'prompt' string and what the reward function reads
(exact_match: 'answer'). Generation runs on megatron-core's engine and scoring through the reward
functions, as in training (rollout and reward settings default to the run's own, read from the
run's config.json). A sample is correct when its reward is at least 1, as val/accuracy counts it.

- greedy accuracy: one greedy completion per prompt (what GRPO's validation logs as val/accuracy).
- pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) over n samples per prompt, c of them correct.
- maj@k: majority vote over the answers (the completion's text stripped; for rewards.fn=math the last
  \\boxed{...}; with an environment, the answer it extracted), averaged exactly over all C(n, k)
  subsets of k samples; a tie between t answers counts (correct among them) / t, breaking it at
  random in expectation.

Sampling is reproducible for a given --seed, layout and --batch-prompts (the engine draws one number
per active request and step). Results go to --out as JSON (with the sampling settings, seed and
versions) and to the console as a table.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", help="our checkpoint, or a run directory (its latest checkpoint)")
    model.add_argument("--hf", help="a Hugging Face model directory")
    p.add_argument("--data", required=True, help="JSONL or parquet rows: 'prompt' and what the reward reads")
    p.add_argument("--n", "--num-samples", dest="n", type=int, default=0,
                   help="samples per prompt for pass@k and maj@k (0: greedy only); under torchrun write --num-samples "
                        "(torchrun's own parser takes --n for its options)")
    p.add_argument("--k", default="", help="comma-separated k values, each <= n (default: 1 and n)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the run's, else 1)")
    p.add_argument("--top-p", type=float, help="nucleus sampling (default: the run's, else off)")
    p.add_argument("--top-k", type=int, help="top-k sampling (default: the run's, else off)")
    p.add_argument("--max-new-tokens", type=int, help="default: the run's rollout.max_new_tokens, else 256")
    p.add_argument("--stop", help="comma-separated stop strings (default: the run's)")
    p.add_argument("--max-turns", type=int, help="turns per episode with a multi-turn environment (default: the run's)")
    p.add_argument("--max-sequence-length", type=int,
                   help="tokens an episode may hold, prompt included (default: the run's rollout.max_sequence_length)")
    p.add_argument("--reward", help="reward function, as rewards.fn (default: the run's validation reward, else "
                                    "exact_match)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--batch-prompts", type=int, default=64, help="prompts given to the engine at once")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N rows (0: all)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], help="default: the run's")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (0: torch's default)")
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--samples", help="write every sample (prompt, completion, reward, the answer extracted from the "
                   "completion, the row's reference answer) here as JSONL")
    return p.parse_args(argv)


def run_config(args):
    """The run's own Config where the checkpoint has one (its rollout and reward settings), else the
    defaults; the command line's settings on top."""
    from megatron_rl import checkpointing
    from megatron_rl.config import Config, ConfigError, ParallelConfig, from_dict

    cfg = Config()
    if args.checkpoint:
        path = Path(args.checkpoint)
        if not checkpointing.is_ours(path):
            raise ConfigError(f"--checkpoint {str(path)!r} is not a megatron-rl checkpoint or run directory; for a "
                              "Hugging Face model use --hf.")
        path = checkpointing.resolve(path)
        saved = path.parent.parent / "config.json"  # <run_dir>/checkpoints/step_N
        if saved.is_file():
            cfg = from_dict(json.loads(saved.read_text()))
        else:
            cfg.rollout.max_new_tokens = 256
    elif not Path(args.hf).is_dir():
        raise ConfigError(f"--hf {args.hf!r} is not a directory; point it at a Hugging Face model directory.")
    else:
        cfg.rollout.max_new_tokens = 256
    cfg.parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep)
    cfg.lora.rank = 0
    r = cfg.rollout
    for name in ("temperature", "top_p", "top_k", "max_new_tokens", "max_turns", "max_sequence_length"):
        if getattr(args, name) is not None:
            setattr(r, name, getattr(args, name))
    if args.stop is not None:
        r.stop = [s for s in args.stop.split(",") if s]
    if args.precision:
        cfg.train.precision = args.precision
    reward = args.reward or cfg.rewards.val_fn or cfg.rewards.fn
    if reward == "reward_model":
        reward = args.reward or "exact_match"  # a run trained on a reward model still validates on its val_fn
    if args.reward == "reward_model":
        raise ConfigError("--reward reward_model gives scores, not correctness; use a reward function such as "
                          "exact_match or math.")
    cfg.rewards.fn, cfg.rewards.val_fn = reward, ""
    r.validate()
    if args.n < 0 or args.batch_prompts < 1:
        raise ConfigError("--n must be >= 0 and --batch-prompts >= 1.")
    ks = [int(k) for k in args.k.split(",") if k.strip()] if args.k else sorted({1, args.n}) if args.n else []
    if any(not 0 < k <= args.n for k in ks):
        raise ConfigError(f"--k {','.join(map(str, ks))}: every k must be between 1 and --n ({args.n}); raise --n "
                          "or lower k.")
    if args.n > 1 and r.top_k == 1:
        raise ConfigError(f"--n {args.n} samples with --top-k 1 would all be the greedy one; sample with top_k 0 "
                          "or > 1.")
    return cfg, ks


def answer_of(reward: str, completion: str):
    """The answer a completion gives, for majority voting: the last \\boxed{...} for math, else its
    stripped text (None when empty)."""
    text = completion.strip()
    if reward == "math" and "\\boxed{" in text:
        start = text.rindex("\\boxed{") + len("\\boxed{")
        depth, end = 1, start
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        text = text[start:end - 1].strip() if not depth else text[start:].strip()
    return text or None


def generate_all(engine, scorer, tokenizer, prompts, metadata, n, seed, batch, greedy, bar, answer, cfg):
    """This rank's prompts in batches: per prompt, its n samples as (completion text, reward, answer);
    with a multi-turn environment, episodes (the text holds the environment's observations too, the
    answer is the one the environment extracted)."""
    from megatron_rl.data.tokenizer import decode_texts
    from megatron_rl.rollout.engine import sampling_seed
    from megatron_rl.rollout.episodes import generate_scored

    out = []
    for b in range(0, len(prompts), batch):
        ids, meta = prompts[b:b + batch], metadata[b:b + batch]
        rollout, scores, answers, _ = generate_scored(engine, scorer, tokenizer, ids, meta, n,
                                                      sampling_seed(seed, batch=b // batch), cfg,
                                                      cfg.rollout.max_sequence_length, greedy=greedy)
        completions, rewards = decode_texts(tokenizer, rollout.completions), scores.rewards
        answers = answers or [answer(c) for c in completions]
        for i in range(len(ids)):
            span = slice(i * n, (i + 1) * n)
            out.append(list(zip(completions[span], rewards[span], answers[span])))
        bar.update(len(ids))
    return out


def gather(mine: list, rank: int, size: int, total: int) -> list:
    """Every data-parallel rank's results (prompts rank::size each) back in prompt order."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [None] * size
    dist.all_gather_object(parts, mine, group=ps.get_data_parallel_group())
    out = [None] * total
    for r, part in enumerate(parts):
        out[r::size] = part
    return out


def evaluate(args) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from tqdm import tqdm

    from megatron_rl.data.rl import encode_prompts
    from megatron_rl.data.rows import read_rows, report_skipped
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.environments.rewards import build_scorer
    from megatron_rl.rollout.engine import RolloutEngine, sampling_seed
    from megatron_rl.rollout.episodes import check_observation_format
    from megatron_rl.rollout.evaluate import maj_at_k, pass_at_k
    from megatron_rl.training.frozen import load_frozen
    from megatron_rl.training.setup import compute_dtype

    cfg, ks = args.cfg, args.ks
    r = cfg.rollout
    frozen = load_frozen(cfg, args.checkpoint or args.hf)
    if frozen.model.head != "lm":
        from megatron_rl.config import ConfigError
        raise ConfigError(f"{args.checkpoint or args.hf!r} is a reward model (a scalar head); evaluate a policy.")
    tokenizer = load_tokenizer(frozen.tokenizer_dir, cfg.data.pad_token)
    check_observation_format(cfg, tokenizer)
    rows = read_rows(args.data)
    if args.limit:
        rows = rows.keep(list(range(min(args.limit, len(rows)))))
    prompts, metadata = encode_prompts(rows, tokenizer, 1 << 30)
    report_skipped(rows, None)
    r.max_sequence_length = max(r.max_sequence_length, max(map(len, prompts)) + r.max_new_tokens)
    r.max_requests = max(r.max_requests, args.batch_prompts * max(args.n, 1))
    engine = RolloutEngine(frozen.chunks, frozen.model, tokenizer, r, compute_dtype(cfg))
    scorer = build_scorer(cfg, cfg.rewards.fn, tokenizer)

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine, mine_meta = prompts[rank::size], metadata[rank::size]
    passes = [("greedy", 1, True)] + ([("sampled", args.n, False)] if args.n else [])
    results, t0 = {}, time.perf_counter()
    for name, n, greedy in passes:
        with tqdm(total=len(prompts), desc=name, unit="prompt", disable=dist.get_rank() != 0) as bar:
            bar.update(0)
            results[name] = gather(generate_all(engine, scorer, tokenizer, mine, mine_meta, n, sampling_seed(args.seed, rank=rank),
                                                args.batch_prompts, greedy, _Scaled(bar, size),
                                                lambda c: answer_of(cfg.rewards.fn, c), cfg),
                                   rank, size, len(prompts))
    scorer.close()
    seconds = time.perf_counter() - t0

    greedy = [p[0][1] >= 1 for p in results["greedy"]]
    summary = {"greedy_accuracy": sum(greedy) / len(greedy)}
    if args.n:
        sampled = results["sampled"]
        correct = [[s[1] >= 1 for s in p] for p in sampled]
        summary["sample_accuracy"] = sum(map(sum, correct)) / (len(correct) * args.n)
        summary["reward_mean"] = sum(s[1] for p in sampled for s in p) / (len(sampled) * args.n)
        for k in ks:
            summary[f"pass@{k}"] = sum(pass_at_k(args.n, sum(c), k) for c in correct) / len(correct)
        for k in ks:
            summary[f"maj@{k}"] = sum(maj_at_k([s[2] for s in p], c, k) for p, c in zip(sampled, correct)) / len(correct)
    import megatron.core
    import transformers

    out = {
        "model": str(args.checkpoint or args.hf), "data": str(args.data), "prompts": len(prompts), **summary,
        "sampling": {"n": args.n, "k": ks, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                     "max_new_tokens": r.max_new_tokens, "stop": list(r.stop), "seed": args.seed,
                     "batch_prompts": args.batch_prompts},
        "reward": cfg.rewards.fn, "precision": str(compute_dtype(cfg)).removeprefix("torch."),
        "layout": {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "ep": cfg.parallel.ep, "dp": size},
        "versions": {"torch": torch.__version__, "megatron-core": megatron.core.__version__,
                     "transformers": transformers.__version__},
        "seconds": round(seconds, 2),
    }
    if dist.get_rank() == 0 and args.samples:
        write_atomically(Path(args.samples), "".join(
            json.dumps({"prompt_index": i, "sample": j, "prompt": rows[i]["prompt"], "completion": c, "reward": rw,
                        "extracted_answer": a, "reference": rows[i].get("answer"), "greedy": name == "greedy"}) + "\n"
            for name in results for i, p in enumerate(results[name]) for j, (c, rw, a) in enumerate(p)))
    return out


class _Scaled:
    """A progress bar that counts every rank's prompts from rank 0's (the ranks go at one pace)."""

    def __init__(self, bar, size):
        self.bar, self.size = bar, size

    def update(self, n):
        self.bar.update(min(n * self.size, self.bar.total - self.bar.n))


def write_atomically(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def table(out: dict) -> str:
    keys = [k for k in out if k == "greedy_accuracy" or k.startswith(("pass@", "maj@")) or k == "sample_accuracy"]
    s = out["sampling"]
    lines = [f"{out['model']} on {out['data']} ({out['prompts']} prompts, reward {out['reward']}; n={s['n']}, "
             f"temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']}, seed {s['seed']})"]
    lines += [f"  {k:18s} {100 * out[k]:6.2f}%" for k in keys]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rl import platform
    from megatron_rl.config import ConfigError
    from megatron_rl.data.rows import DataError

    try:
        launch = platform.read_launch()
        args.cfg, args.ks = run_config(args)
    except (ConfigError, FileNotFoundError, platform.LaunchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    p = args.cfg.parallel
    platform.init_distributed(launch)
    try:
        p.validate(launch.world_size)
        platform.init_model_parallel(tp=p.tp, pp=p.pp, ep=p.ep, seed=args.cfg.train.seed)
        out = evaluate(args)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as e:
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        platform.shutdown()
        return 2
    if launch.rank == 0:
        print(table(out))
        if args.out:
            write_atomically(Path(args.out), json.dumps(out, indent=2) + "\n")
    platform.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
