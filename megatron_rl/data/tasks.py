"""Where a run's data comes from: a built-in synthetic task (generated into <run_dir>/data, with its
own tokenizer) or the user's JSONL files; and which tokenizer encodes it."""

import json
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import Config, ConfigError

from .tokenizer import build_bpe_tokenizer, build_char_tokenizer, load_tokenizer

TASKS = ("arithmetic", "sliding_puzzle")


def bpe_size(spec) -> int:
    """data.tokenizer 'bpe' or 'bpe:N': the size of the task's own BPE tokenizer (64, or N: its specials,
    characters and merges); 0 for anything else (a directory)."""
    spec = str(spec)
    if spec == "bpe":
        return 64
    if spec.startswith("bpe:") and spec[4:].isdigit():
        return int(spec[4:])
    return 0


def data_files(cfg: Config, run_dir: Path, wrong_answers=None):
    """(tokenizer, train JSONL path, val JSONL path or None). Rank 0 writes, every rank returns. For DPO and
    reward models the task's problems become preference pairs; wrong_answers(cfg, tokenizer) makes the
    sampler of the 'policy' negatives (rollout/policy_samples.py wrong_answer_sampler)."""
    train_path, val_path = cfg.data.train_path, cfg.data.val_path or None
    tok_path = cfg.data.tokenizer or cfg.model.hf_path
    if cfg.data.task:
        from . import arithmetic

        if cfg.data.task not in TASKS:
            raise ConfigError(f"unknown data.task {cfg.data.task!r}; built in: {', '.join(TASKS)} "
                              f"(or set data.task='' and data.train_path).")
        data_dir = run_dir / "data"
        if dist.get_rank() == 0:
            d = cfg.data
            if d.task == "sliding_puzzle":
                from . import puzzle

                puzzle.write_splits(data_dir, d.num_train, d.num_val, d.board_size, d.scramble, d.seed, d.noise)
                characters = puzzle.ALPHABET
            else:
                arithmetic.write_splits(data_dir, d.num_train, d.num_val, d.digits, d.seed, d.noise, d.ops, d.train_ops,
                                        d.tool)
                characters = arithmetic.alphabet(d.ops, d.tool)
            if not tok_path:
                build_char_tokenizer(characters, data_dir / "tokenizer")
            elif bpe_size(tok_path):
                rows = [json.loads(line) for line in (data_dir / "train.jsonl").read_text().splitlines()]
                build_bpe_tokenizer([r["prompt"] + (r.get("response") or "".join(t["content"] for t in r["turns"]))
                                     for r in rows], bpe_size(tok_path),
                                    data_dir / "tokenizer")
        train_path, val_path = data_dir / "train.jsonl", data_dir / "val.jsonl"
        tok_path = data_dir / "tokenizer" if not tok_path or bpe_size(tok_path) else tok_path
    dist.barrier()
    tokenizer = load_tokenizer(tok_path, cfg.data.pad_token)
    if cfg.data.task and cfg.algorithm.name in PREFERENCE_ALGORITHMS:
        train_path, val_path = _preference_splits(cfg, tokenizer, train_path, val_path, wrong_answers)
    return tokenizer, train_path, val_path


PREFERENCE_ALGORITHMS = ("dpo", "rm")


def _preference_splits(cfg: Config, tokenizer, train_path: Path, val_path: Path, wrong_answers) -> tuple[Path, Path]:
    """The task's problems as preference pairs (pairs_train.jsonl, pairs_val.jsonl beside them):
    chosen the true answer, rejected a wrong one of the data.negatives mix. Wrong answers of the
    starting policy ('policy') are sampled collectively by every rank."""
    from . import arithmetic
    from .rows import read_rows

    sampler = wrong_answers(cfg, tokenizer) if "policy" in cfg.data.negatives else None
    paths = train_path.with_name("pairs_train.jsonl"), val_path.with_name("pairs_val.jsonl")
    splits = []
    for offset, source in enumerate((train_path, val_path)):
        splits.append(arithmetic.preference_rows(read_rows(source), cfg.data.negatives, cfg.data.digits,
                                                 cfg.data.seed + 1 + offset, sampler))
    if dist.get_rank() == 0:
        for path, rows in zip(paths, splits):
            arithmetic.write_jsonl(path, rows)
    dist.barrier()
    return paths
