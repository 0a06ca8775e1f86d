"""SFT data: JSONL rows -> fixed-length token tensors with a loss mask on response tokens only.

Rows are either {"prompt": str, "response": str} or {"messages": [{"role", "content"}, ...]}
(chat format: the tokenizer's chat template renders all but the last assistant turn as the
prompt, the last assistant turn is the response).
"""

import json
from pathlib import Path

import torch


class DataError(ValueError):
    """A malformed data file or row; the message names the file and line."""


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist.")
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from None
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows.")
    return rows


def split_row(row: dict, tokenizer, where: str) -> tuple[str, str]:
    """(prompt text, response text) of one row."""
    if "prompt" in row and "response" in row:
        return str(row["prompt"]), str(row["response"])
    if "messages" in row:
        msgs = row["messages"]
        if not msgs or msgs[-1].get("role") != "assistant":
            raise DataError(f"{where}: the last message must have role 'assistant'.")
        if getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        else:
            prompt = "".join(f"{m['role']}: {m['content']}\n" for m in msgs[:-1]) + "assistant: "
        return prompt, str(msgs[-1]["content"])
    raise DataError(f"{where}: a row needs 'prompt' and 'response', or 'messages'; got keys {sorted(row)}.")


def prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """[bos] + the prompt's tokens (no second bos when a chat template already rendered one)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [p if bos is None or p[:1] == [bos] else [bos] + p for p in ids]


def encode(rows: list[dict], tokenizer, seq_length: int, source: str) -> dict[str, torch.Tensor]:
    """Tokenize rows into tokens/labels/loss_mask of shape (N, seq_length).

    Sequence: [bos] prompt response [eos], left-aligned, padded with pad. labels[t] = tokens[t+1];
    loss_mask marks positions whose label is a response token (or the final eos).
    """
    n = len(rows)
    tokens = torch.full((n, seq_length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((n, seq_length), tokenizer.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((n, seq_length), dtype=torch.float)
    prompt_lens = torch.zeros(n, dtype=torch.long)
    pairs = [split_row(row, tokenizer, f"{source}:{i + 1}") for i, row in enumerate(rows)]
    prompts = prompt_ids(tokenizer, [p for p, _ in pairs])
    responses = tokenizer([r for _, r in pairs], add_special_tokens=False)["input_ids"]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        where = f"{source}:{i + 1}"
        ids = p + r + [tokenizer.eos_token_id]
        if len(ids) > seq_length + 1:
            raise DataError(f"{where}: {len(ids)} tokens exceed data.seq_length={seq_length} + 1; "
                            f"raise data.seq_length or shorten the row.")
        inp, tgt = ids[:-1], ids[1:]
        tokens[i, : len(inp)] = torch.tensor(inp)
        labels[i, : len(tgt)] = torch.tensor(tgt)
        loss_mask[i, len(p) - 1 : len(inp)] = 1.0
        prompt_lens[i] = len(p)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "prompt_lens": prompt_lens}


class Batches:
    """Deterministic, resumable stream of global batches; each DP rank takes its slice.

    The position (`consumed`) is all the state: a resumed run continues with the same samples.
    """

    def __init__(self, data: dict[str, torch.Tensor], global_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        self.data, self.gbs, self.seed = data, global_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.n = len(next(iter(data.values())))
        self.consumed = 0  # samples taken so far (over all DP ranks)

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g)

    def next(self) -> dict[str, torch.Tensor]:
        idx = []
        pos = self.consumed
        while len(idx) < self.gbs:
            epoch, offset = divmod(pos, self.n)
            take = min(self.gbs - len(idx), self.n - offset)
            idx.append(self._order(epoch)[offset : offset + take])
            pos += take
        self.consumed = pos
        idx = torch.cat(idx)
        per_rank = self.gbs // self.dp_size
        mine = idx[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return {k: v[mine] for k, v in self.data.items()}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict):
        self.consumed = int(state["consumed"])


def microbatches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    n = len(batch["tokens"])
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, n, micro_batch_size)]
