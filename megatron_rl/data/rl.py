"""RL data: prompt rows -> prompt token ids, and rollouts -> fixed-length training tensors."""

import torch

from megatron_rl.config import ConfigError

from .rows import DataError, Rows
from .tokenizer import prompt_ids


def prompt_splits(cfg, run_dir):
    """An RL run's data: (tokenizer, (train prompts' ids, their metadata), (the same for validation,
    empty without a validation file)). Sets model.vocab_size from the tokenizer where it is 0."""
    from .rows import read_rows, report_skipped
    from .tasks import data_files

    tokenizer, train_path, val_path = data_files(cfg, run_dir)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = len(tokenizer)
    if cfg.rollout.top_k >= cfg.model.vocab_size:
        raise ConfigError(f"rollout.top_k={cfg.rollout.top_k} keeps every token of the vocabulary ({cfg.model.vocab_size}"
                          f" tokens); lower it, or set 0 for no top-k filter.")
    seq, skip = cfg.data.seq_length, cfg.data.on_bad_row
    train_rows, val_rows = read_rows(train_path, skip), read_rows(val_path, skip) if val_path else None
    train = encode_prompts(train_rows, tokenizer, seq)
    val = encode_prompts(val_rows, tokenizer, seq) if val_rows else ([], [])
    report_skipped(train_rows, val_rows)
    return tokenizer, train, val


def encode_prompts(rows: Rows, tokenizer, seq_length: int) -> tuple[list[list[int]], list[dict]]:
    """Token ids ([bos] prompt) and metadata (every other field, e.g. 'answer') of each row; a prompt
    must leave room for a completion in seq_length tokens."""
    good = []
    for i, row in enumerate(rows):
        if "prompt" not in row:
            rows.bad(DataError(f"{rows.where(i)}: an RL row needs a 'prompt' (and what its reward function reads, "
                               f"e.g. 'answer'); got keys {sorted(row)}."))
        elif not isinstance(row["prompt"], str):
            rows.bad(DataError(f"{rows.where(i)}: 'prompt' must be a string, not {type(row['prompt']).__name__}."))
        else:
            good.append(i)
    rows = rows.keep(good)
    prompts = prompt_ids(tokenizer, [row["prompt"] for row in rows])
    fits = []
    for i, p in enumerate(prompts):
        if len(p) >= seq_length:
            rows.bad(DataError(f"{rows.where(i)}: the prompt's {len(p)} tokens leave no room for a completion in "
                               f"data.seq_length={seq_length}; raise data.seq_length or shorten the prompt."))
        else:
            fits.append(i)
    if not fits:
        raise DataError(f"{rows.source}: no row is left after skipping bad ones.")
    return [prompts[i] for i in fits], [{k: v for k, v in rows[i].items() if k != "prompt"} for i in fits]


def pack(prompts: list[list[int]], completions: list[list[int]], seq_length: int, pad_id: int,
         masks: list[list[float]] | None = None, fill: dict[str, float] | None = None,
         **per_token: list[list[float]]) -> dict[str, torch.Tensor]:
    """Samples -> tokens, labels (next token), loss_mask (the completion's tokens; with masks, those
    whose mask is 1: a multi-turn episode's generated tokens, not the environment's) of shape (N, S),
    and each per-token list in `per_token` (aligned with the completion) placed at its labels, fill[name]
    (default 0) elsewhere."""
    n = len(prompts)
    tokens = torch.full((n, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_length), pad_id, dtype=torch.long)
    mask = torch.zeros((n, seq_length))
    extra = {k: torch.full((n, seq_length), (fill or {}).get(k, 0.0)) for k in per_token}
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = p + c
        if len(ids) - 1 > seq_length:
            raise DataError(f"a prompt of {len(p)} tokens plus {len(c)} generated ones exceeds data.seq_length="
                            f"{seq_length} + 1; raise data.seq_length or lower rollout.max_new_tokens.")
        tokens[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        labels[i, : len(ids) - 1] = torch.tensor(ids[1:])
        span = slice(len(p) - 1, len(ids) - 1)  # positions whose label is a completion token
        mask[i, span] = torch.tensor(masks[i][: len(c)], dtype=torch.float) if masks else 1.0
        for k, values in per_token.items():
            extra[k][i, span] = torch.tensor(values[i][: len(c)], dtype=torch.float)
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, **extra}
