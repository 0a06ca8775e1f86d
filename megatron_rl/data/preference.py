"""Preference data for DPO and reward models: JSONL pairs -> token tensors, one pair per row.

Rows (TRL's formats):
    {"prompt": str, "chosen": str, "rejected": str}                       plain text
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}  conversational
    {"chosen": [messages], "rejected": [messages]}                        full conversations sharing a prefix
Optional fields: "margin" (a number; the reward model's Bradley-Terry margin), "kind" (a label;
validation reports accuracy per kind), and anything else, kept as metadata (e.g. "answer").

The prompt is tokenized once and each response on its own, so chosen and rejected share the same
prompt ids; with a chat template the response is what the template renders after the generation
prompt. A sequence is [bos] prompt response [eos].

Tensors are (N, 2, S): index 0 of the second dimension is the chosen response, 1 the rejected.
A pair therefore never splits across microbatches or data-parallel ranks; `pair_microbatches`
flattens each microbatch to (2 x pairs, S) rows interleaved [c0, r0, c1, r1, ...].
"""

from dataclasses import dataclass

import torch

from .batches import microbatches
from .rows import DataError
from .tokenizer import prompt_ids


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]  # response ids, eos included
    rejected: list[int]
    truncated: bool
    margin: float
    kind: str
    metadata: dict


def _is_messages(x) -> bool:
    return isinstance(x, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in x)


def _render(tokenizer, messages, where: str, generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: conversational rows need a chat template, and the tokenizer has none; give "
                        f"plain-text rows or a tokenizer with a chat template (data.tokenizer).")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _response_text(tokenizer, prompt_msgs: list, response_msgs: list, prompt_text: str, where: str) -> str:
    """What the chat template renders for the response after the prompt's generation prompt."""
    full = _render(tokenizer, prompt_msgs + response_msgs, where, generation_prompt=False)
    if not full.startswith(prompt_text):
        raise DataError(f"{where}: the chat template does not render the prompt as a prefix of prompt + response, so "
                        f"the response cannot be cut out of it; use plain-text rows.")
    return full[len(prompt_text):]


def pair_texts(row: dict, tokenizer, where: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text of one row, rendered with the chat template when conversational."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataError(f"{where}: a preference row needs 'chosen' and 'rejected' (and 'prompt' unless they are "
                        f"full conversations); got {keys}.")
    chosen, rejected = row["chosen"], row["rejected"]
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are identical, which teaches nothing; drop the row or fix it.")
    prompt = row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str):
        return prompt, chosen, rejected
    if _is_messages(chosen) and _is_messages(rejected):
        if prompt is None:  # full conversations: the prompt is their shared message-level prefix
            n = 0
            while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
                n += 1
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
            if not prompt:
                raise DataError(f"{where}: the 'chosen' and 'rejected' conversations share no leading messages, so "
                                f"they have no common prompt; give a 'prompt' field.")
        if _is_messages(prompt):
            text = _render(tokenizer, prompt, where, generation_prompt=True)
            return (text, _response_text(tokenizer, prompt, chosen, text, where),
                    _response_text(tokenizer, prompt, rejected, text, where))
    raise DataError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings, or all lists of "
                    f"{{'role', 'content'}} messages (the prompt may be left out of full conversations).")


def truncate(prompt: list[int], responses: list[list[int]], budget: int, max_prompt: int, max_completion: int,
             mode: str) -> tuple[list[int], list[list[int]], bool]:
    """Fit [prompt + response] for every response into `budget` tokens. max_prompt cuts the prompt
    (keep_end: its last tokens; keep_start: its first), max_completion keeps each response's first
    tokens; a pair still too long loses the start of the shared prompt (keep_end) or the end of
    its responses (keep_start). Returns (prompt, responses, whether anything was cut)."""
    cut = False
    if max_prompt and len(prompt) > max_prompt:
        prompt, cut = (prompt[-max_prompt:] if mode == "keep_end" else prompt[:max_prompt]), True
    if max_completion and any(len(r) > max_completion for r in responses):
        responses, cut = [r[:max_completion] for r in responses], True
    over = len(prompt) + max(len(r) for r in responses) - budget
    if over > 0:
        cut = True
        if mode == "keep_end":
            drop = min(over, len(prompt) - 1)  # keep at least one prompt token (bos, when there is one)
            prompt, over = prompt[drop:], over - drop
        if over > 0:
            responses = [r[: budget - len(prompt)] for r in responses]
    return prompt, responses, cut


def encode_pairs(rows: list[dict], tokenizer, budget: int, source: str, max_prompt: int = 0,
                 max_completion: int = 0, mode: str = "keep_end") -> list[Pair]:
    """Tokenize preference rows; every pair fits `budget` tokens of [bos] prompt response [eos]."""
    eos = [tokenizer.eos_token_id]
    texts = [pair_texts(row, tokenizer, f"{source}:{i + 1}") for i, row in enumerate(rows)]
    prompts = prompt_ids(tokenizer, [p for p, _, _ in texts])
    chosen = tokenizer([c for _, c, _ in texts], add_special_tokens=False)["input_ids"]
    rejected = tokenizer([r for _, _, r in texts], add_special_tokens=False)["input_ids"]
    pairs = []
    for i, row in enumerate(rows):
        where = f"{source}:{i + 1}"
        margin = row.get("margin", 0.0)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise DataError(f"{where}: 'margin' must be a number, got {margin!r}.")
        p, (c, r), cut = truncate(prompts[i], [chosen[i] + eos, rejected[i] + eos], budget, max_prompt,
                                  max_completion, mode)
        if c == r:
            raise DataError(f"{where}: 'chosen' and 'rejected' are identical once tokenized and truncated; raise "
                            f"data.seq_length or data.max_completion_length, or drop the row.")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected", "margin", "kind")}
        pairs.append(Pair(p, c, r, cut, float(margin), str(row.get("kind", "")), meta))
    return pairs


def lm_tensors(pairs: list[Pair], seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """DPO's tensors, (N, 2, S) each: tokens, labels (the next token) and loss_mask (labels that are
    response tokens); plus margin (N,)."""
    n = len(pairs)
    tokens = torch.full((n, 2, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((n, 2, seq_length), pad_id, dtype=torch.long)
    mask = torch.zeros((n, 2, seq_length))
    for i, pair in enumerate(pairs):
        for j, response in enumerate((pair.chosen, pair.rejected)):
            ids = pair.prompt + response
            tokens[i, j, : len(ids) - 1] = torch.tensor(ids[:-1])
            labels[i, j, : len(ids) - 1] = torch.tensor(ids[1:])
            mask[i, j, len(pair.prompt) - 1 : len(ids) - 1] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, "margin": torch.tensor([p.margin for p in pairs])}


def score_tensors(pairs: list[Pair], seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """A reward model's tensors: tokens (N, 2, S) (the whole sequence, right-padded), score_pos (N, 2)
    (where transformers reads the score), margin (N,)."""
    from model_providers.heads import score_positions

    n = len(pairs)
    tokens = torch.full((n, 2, seq_length), pad_id, dtype=torch.long)
    for i, pair in enumerate(pairs):
        for j, response in enumerate((pair.chosen, pair.rejected)):
            ids = pair.prompt + response
            tokens[i, j, : len(ids)] = torch.tensor(ids)
    return {"tokens": tokens, "score_pos": score_positions(tokens, pad_id), "margin": torch.tensor([p.margin for p in pairs])}


def flatten_pairs(m: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pairs (N, 2, ...) as rows [c0, r0, c1, r1, ...]; per-pair tensors (N,) stay per pair."""
    return {k: v.flatten(0, 1) if v.dim() >= 2 else v for k, v in m.items()}


def pair_microbatches(batch: dict[str, torch.Tensor], pairs_per_microbatch: int) -> list[dict[str, torch.Tensor]]:
    """Microbatches of whole pairs, each flattened to rows (flatten_pairs)."""
    return [flatten_pairs(m) for m in microbatches(batch, pairs_per_microbatch)]


@dataclass
class PreferenceData:
    """What a preference run trains and validates on."""

    tokenizer: object
    train: dict[str, torch.Tensor]  # (N, 2, S) per response, (N,) per pair
    val: dict[str, torch.Tensor] | None
    paths: dict[str, object]  # split name -> JSONL path
    val_prompts: tuple | None  # (prompt ids, metadata) of validation rows with an 'answer', for greedy decoding
    kinds: list[str]  # the rows' 'kind' labels; data["kind"] indexes this list
    cut: dict[str, int]  # split name -> pairs truncated to fit
    note: str  # the same, for the log

    def truncated(self) -> dict[str, float]:
        return {"data/truncated_pairs": float(self.cut["train"]), "data/truncated_val_pairs": float(self.cut.get("val", 0))}


def prepare(cfg, run_dir, wrong_answers=None) -> PreferenceData:
    """Read, tokenize and tensorize the train and val pairs for a language model (DPO) or a score
    model (reward model); sets model.vocab_size from the tokenizer when it is 0. wrong_answers: see
    tasks.data_files."""
    from .rows import read_rows
    from .tasks import data_files

    tokenizer, train_path, val_path = data_files(cfg, run_dir, wrong_answers)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = len(tokenizer)
    d, score = cfg.data, cfg.model.head == "score"
    budget = d.seq_length if score else d.seq_length + 1
    splits, tensors = {}, {}
    for name, path in (("train", train_path), ("val", val_path)):
        if path:
            splits[name] = encode_pairs(read_rows(path), tokenizer, budget, str(path), d.max_prompt_length,
                                        d.max_completion_length, d.truncation_mode)
    kinds = sorted({p.kind for pairs in splits.values() for p in pairs})
    for name, pairs in splits.items():
        make = score_tensors if score else lm_tensors
        tensors[name] = {**make(pairs, d.seq_length, tokenizer.pad_token_id),
                         "kind": torch.tensor([kinds.index(p.kind) for p in pairs])}
    cut = {name: sum(p.truncated for p in pairs) for name, pairs in splits.items()}
    note = "; ".join(f"{name}: {cut[name]} of {len(pairs)} pairs truncated to fit data.seq_length={d.seq_length}"
                     for name, pairs in splits.items())
    val = splits.get("val", [])
    answered = [p for p in val if "answer" in p.metadata]
    val_prompts = ([p.prompt for p in answered], [p.metadata for p in answered]) if answered and not score else None
    return PreferenceData(tokenizer, tensors["train"], tensors.get("val"), {"train": train_path, "val": val_path},
                          val_prompts, kinds, cut, note)
