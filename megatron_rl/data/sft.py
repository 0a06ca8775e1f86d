"""SFT data: JSONL rows -> fixed-length token tensors with a loss mask on response tokens only.

Rows are either {"prompt": str, "response": str} or {"messages": [{"role", "content"}, ...]}
(chat format: the tokenizer's chat template renders all but the last assistant turn as the
prompt, the last assistant turn is the response).
"""

import json
from pathlib import Path

import torch

from megatron_rl.config import UserError


class DataError(UserError, ValueError):
    """A malformed data file or row; the message names the file and line."""


class Rows(list):
    """A data file's rows, with each row's line in the file (its row number in a parquet file) and the
    messages of the rows dropped under data.on_bad_row=skip."""

    def __init__(self, source: str, on_bad_row: str = "fail"):
        super().__init__()
        self.source, self.on_bad_row, self.lines, self.skipped = source, on_bad_row, [], []

    def where(self, i: int) -> str:
        return f"{self.source}:{self.lines[i] if i < len(self.lines) else i + 1}"

    def bad(self, error: DataError):
        """A bad row: raised (fail), or counted and dropped by the caller (skip)."""
        if self.on_bad_row != "skip":
            raise error
        self.skipped.append(str(error))

    def keep(self, good: list[int]) -> "Rows":
        """These rows only (the others were bad and skipped), with their lines."""
        kept = Rows(self.source, self.on_bad_row)
        kept.extend(self[i] for i in good)
        kept.lines, kept.skipped = [self.lines[i] for i in good], self.skipped
        return kept

    def report(self) -> str | None:
        if not self.skipped:
            return None
        return f"data.on_bad_row=skip: dropped {len(self.skipped)} bad row(s) of {self.source}: " + "; ".join(
            self.skipped[:3]) + (" ..." if len(self.skipped) > 3 else "")


def report_skipped(*rows: "Rows | None"):
    """Rank 0 says how many bad rows of each file data.on_bad_row=skip dropped, and where."""
    import torch.distributed as dist

    for r in rows:
        if r is not None and r.report() and (not dist.is_initialized() or dist.get_rank() == 0):
            print(r.report(), flush=True)


def read_jsonl(path: str | Path, on_bad_row: str = "fail") -> Rows:
    """The rows of a JSONL file (one JSON object per line), or of a parquet file (by its suffix)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data file {str(path)!r} is a directory; point at a .jsonl or .parquet file in it.")
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist.")
    rows = Rows(str(path), on_bad_row)
    if path.suffix == ".parquet":
        rows.extend(_read_parquet(path))
        rows.lines = list(range(1, len(rows) + 1))
    else:
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    row = _parse_line(raw, f"{path}:{lineno}")
                except DataError as e:
                    rows.bad(e)
                    continue
                if row is not None:
                    rows.append(row)
                    rows.lines.append(lineno)
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows" + (" left after skipping bad ones" if rows.skipped
                                                                   else "") + ".")
    return rows


def _parse_line(raw: bytes, where: str) -> dict | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte {raw[e.start]:#x} at column {e.start + 1}); "
                        "convert the file to UTF-8.") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg}).") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, not {type(row).__name__}.")
    return row


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow).") from None
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged or foreign file
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e)[:120]}).") from None


def split_row(row: dict, tokenizer, where: str) -> tuple[str, str | list[tuple[str, bool]]]:
    """(prompt text, response) of one row: the response's text, or for an episode ('turns': the
    model's and the environment's messages after the prompt) its (text, trained) segments."""
    if "prompt" in row and "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(
                isinstance(t, dict) and t.get("role") in ("assistant", "environment") and isinstance(t.get("content"), str)
                for t in turns) or turns[-1]["role"] != "assistant":
            raise DataError(f"{where}: 'turns' must be a list of {{'role': 'assistant' or 'environment', 'content': "
                            f"str}} messages ending with the assistant's.")
        return row["prompt"], [(t["content"], t["role"] == "assistant") for t in turns]
    if "prompt" in row and "response" in row:
        for key in ("prompt", "response"):
            if not isinstance(row[key], str):
                raise DataError(f"{where}: {key!r} must be a string, not {type(row[key]).__name__} ({row[key]!r:.40}).")
        return row["prompt"], row["response"]
    if "messages" in row:
        msgs = row["messages"]
        if not msgs or msgs[-1].get("role") != "assistant":
            raise DataError(f"{where}: the last message must have role 'assistant'.")
        if getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        else:
            prompt = "".join(f"{m['role']}: {m['content']}\n" for m in msgs[:-1]) + "assistant: "
        return prompt, str(msgs[-1]["content"])
    raise DataError(f"{where}: a row needs 'prompt' and 'response' (or 'turns'), or 'messages'; got keys {sorted(row)}.")


def prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """[bos] + the prompt's tokens (no second bos when a chat template already rendered one)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [p if bos is None or p[:1] == [bos] else [bos] + p for p in ids]


def encode(rows: Rows, tokenizer, seq_length: int) -> dict[str, torch.Tensor]:
    """Tokenize rows into tokens/labels/loss_mask of shape (N, seq_length).

    Sequence: [bos] prompt response [eos], left-aligned, padded with pad. labels[t] = tokens[t+1];
    loss_mask marks positions whose label is a response token (or the final eos); of an episode's
    response, the model's turns only.
    """
    pairs, good = [], []
    for i, row in enumerate(rows):
        try:
            pairs.append(split_row(row, tokenizer, rows.where(i)))
            good.append(i)
        except DataError as e:
            rows.bad(e)
    prompts = prompt_ids(tokenizer, [p for p, _ in pairs])
    texts = [r for _, r in pairs if isinstance(r, str)]
    tokenized = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    kept = []  # (prompt ids, the whole sequence, the response's trained flags) of each row that fits
    for i, p, (_, response) in zip(good, prompts, pairs):
        if isinstance(response, str):
            r = next(tokenized)
            trained = [1.0] * len(r)
        else:  # each turn tokenized on its own, as rollouts append them; the environment's out of the loss
            parts = [(tokenizer(text, add_special_tokens=False)["input_ids"], flag) for text, flag in response]
            r = [t for ids, _ in parts for t in ids]
            trained = [float(flag) for ids, flag in parts for _ in ids]
        ids = p + r + [tokenizer.eos_token_id]
        if len(ids) > seq_length + 1:
            rows.bad(DataError(f"{rows.where(i)}: {len(ids)} tokens exceed data.seq_length={seq_length} + 1; "
                               f"raise data.seq_length or shorten the row."))
        else:
            kept.append((p, ids, trained + [1.0]))
    if not kept:
        raise DataError(f"{rows.source}: no row is left after skipping bad ones.")
    n = len(kept)
    tokens = torch.full((n, seq_length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((n, seq_length), tokenizer.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((n, seq_length), dtype=torch.float)
    prompt_lens = torch.zeros(n, dtype=torch.long)
    for i, (p, ids, trained) in enumerate(kept):
        inp, tgt = ids[:-1], ids[1:]
        tokens[i, : len(inp)] = torch.tensor(inp)
        labels[i, : len(tgt)] = torch.tensor(tgt)
        loss_mask[i, len(p) - 1 : len(inp)] = torch.tensor(trained)
        prompt_lens[i] = len(p)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "prompt_lens": prompt_lens}


class Batches:
    """Deterministic, resumable stream of global batches; each DP rank takes every dp_size-th sample.

    The position (`consumed`) is all the state: a resumed run continues with the same samples.
    """

    def __init__(self, data: dict[str, torch.Tensor], global_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        self.data, self.gbs, self.seed = data, global_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.n = len(next(iter(data.values())))
        self.consumed = 0  # samples taken so far (over all DP ranks)
        self._epoch = (-1, None)  # the current epoch and its permutation, drawn once per epoch

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch = (epoch, torch.randperm(self.n, generator=g))
        return self._epoch[1]

    def next(self) -> dict[str, torch.Tensor]:
        idx = []
        pos, end = self.consumed, self.consumed + self.gbs
        while pos < end:  # across an epoch's end: the rest of it, then the next one's start
            epoch, offset = divmod(pos, self.n)
            take = min(end - pos, self.n - offset)
            idx.append(self._order(epoch)[offset : offset + take])
            pos += take
        self.consumed = pos
        # Every dp_size-th sample, starting at this rank's: a contiguous part of the global batch (a GRPO
        # minibatch) then consists of the same contiguous part of each rank's share, at any DP size.
        mine = torch.cat(idx)[self.dp_rank :: self.dp_size]
        return {k: v[mine] for k, v in self.data.items()}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict):
        self.consumed = int(state["consumed"])


def microbatches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    n = len(batch["tokens"])
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, n, micro_batch_size)]
