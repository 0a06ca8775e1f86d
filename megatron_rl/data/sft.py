"""SFT data: JSONL rows -> fixed-length token tensors with a loss mask on response tokens only.

Rows are either {"prompt": str, "response": str} or {"messages": [{"role", "content"}, ...]}
(chat format: the tokenizer's chat template renders all but the last assistant turn as the
prompt, the last assistant turn is the response).
"""


import torch

from .rows import DataError, Rows
from .tokenizer import prompt_ids


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


