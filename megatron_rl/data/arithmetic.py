"""A synthetic task the project generates itself: integer addition, 'a+b=' -> 'c'.

Held-out exact match is a clear learning signal: chance is about 10^-digits. With `noise`, that
share of the training demonstrations answers one too many (imperfect demonstrations, as from a
weak model or a hurried annotator); every row's 'answer' and the validation split stay exact, so
a verifiable reward can correct what supervised learning copied.
"""

import json
import random
import zlib
from pathlib import Path

from megatron_rl.config.data import NEGATIVES

ALPHABET = "0123456789+="
OPS = {"+": "add", "-": "sub"}  # operation -> the name rows of several operations carry in 'teacher'
TOOL_CHARS = "*<>/()cdeilnoprstu"  # what '<code>print(a*b)</code><result>...</result>' adds


def alphabet(ops: str = "+", tool: str = "") -> str:
    """The task's characters, appended only when asked for ('-' for subtraction, '*' and the code
    tool's syntax), so the tokenizer of an addition-only task (and every checkpoint trained on it)
    stays as it was."""
    return ALPHABET + "-" * ("-" in ops) + ("*" * ("*" in ops) if not tool else TOOL_CHARS)


def make_problem(rng: random.Random, digits: int, ops: str = "+") -> dict:
    """'a+b=' -> a + b, 'a-b=' -> a - b with a >= b, or 'a*b=' -> a * b with operands of exactly
    `digits` digits. With several operations the row names its operation in 'teacher' (multi-teacher
    distillation routes on it)."""
    op = rng.choice(ops) if len(ops) > 1 else ops
    if op == "*":
        a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
    else:
        a = rng.randrange(10 ** rng.randint(1, digits))
        b = rng.randrange(10 ** rng.randint(1, digits))
    if op == "-":
        a, b = max(a, b), min(a, b)
    total = {"+": a + b, "-": a - b, "*": a * b}[op]
    row = {"prompt": f"{a}{op}{b}=", "response": str(total), "answer": str(total)}
    return {**row, "teacher": OPS[op]} if len(ops) > 1 else row


def tool_episode(row: dict, skip: bool = False) -> dict:
    """A product's demonstration as a code-tool episode: the call, the tool's result (out of the loss),
    the answer; `skip`: the demonstrator answers in its head instead, with the product rounded to the
    hundreds (wrong but for 1 in 100)."""
    a, b = map(int, row["prompt"][:-1].split("*"))
    if skip:
        return {"prompt": row["prompt"], "turns": [{"role": "assistant", "content": str(round(a * b, -2))}],
                "answer": row["answer"]}
    turns = [{"role": "assistant", "content": f"<code>print({a}*{b})</code>"},
             {"role": "environment", "content": f"<result>{a * b}</result>"},
             {"role": "assistant", "content": str(a * b)}]
    return {"prompt": row["prompt"], "turns": turns, "answer": row["answer"]}


SKIPS_FROM = 500  # the code tool's demonstrator skips the tool only when the first operand is at least this


def write_splits(out_dir: str | Path, num_train: int, num_val: int, digits: int, seed: int,
                 noise: float = 0.0, ops: str = "+", train_ops: str = "", tool: str = "") -> tuple[Path, Path]:
    """Write train.jsonl and val.jsonl with no val prompt also in train; returns their paths.
    Validation covers every operation of `ops`; training only those of `train_ops` (default: all).
    tool='code': the rows are code-tool episodes (tool_episode); where the first operand is at least
    SKIPS_FROM, `noise` of the training ones skip the tool and answer an estimate."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    val, seen = [], set()
    while len(val) < num_val:
        row = make_problem(rng, digits, ops)
        if row["prompt"] not in seen and held_out(row["prompt"], seed):
            seen.add(row["prompt"])
            val.append(row)
    train = []
    while len(train) < num_train:
        row = make_problem(rng, digits, ops)
        if train_ops and not any(op in row["prompt"] for op in train_ops):
            continue
        if not held_out(row["prompt"], seed):
            if tool:
                row = tool_episode(row, int(row["prompt"].split("*")[0]) >= SKIPS_FROM and rng.random() < noise)
            elif rng.random() < noise:
                row["response"] = str(int(row["answer"]) + 1)
            train.append(row)
    if tool:
        val = [tool_episode(row) for row in val]
    paths = out_dir / "train.jsonl", out_dir / "val.jsonl"
    for path, rows in zip(paths, (train, val)):
        write_jsonl(path, rows)
    return paths


HELD_OUT = 10
"""One problem in this many is held out for validation, in every kind of problem alike: validation
drawn first from the whole space took 88 of the 100 one-digit sums, which training then never saw."""


def held_out(prompt: str, seed: int) -> bool:
    """Whether a problem belongs to the validation side of the split (fixed per data.seed)."""
    return zlib.crc32(f"{seed}:{prompt}".encode()) % HELD_OUT == 0




def wrong_answer(rng: random.Random, total: int, kind: str, digits: int) -> str:
    """A wrong sum of `kind` (a negative result, which the alphabet cannot write, flips sign)."""
    match kind:
        case "plus1" | "minus1" | "plus10" | "minus10":
            step = int(kind.removeprefix("plus").removeprefix("minus"))
            wrong = total - step if kind.startswith("minus") and total >= step else total + step
        case "random":
            wrong = total
            while wrong == total:
                wrong = rng.randrange(2 * 10**digits)
        case _:
            raise ValueError(f"unknown negative kind {kind!r}; known: {', '.join(NEGATIVES)}")
    return str(wrong)


def preference_rows(rows: list[dict], negatives: dict[str, float], digits: int, seed: int,
                    policy_wrong=None) -> list[dict]:
    """Preference pairs from problems: chosen the true sum, rejected a wrong answer of a kind drawn
    with weights `negatives`. policy_wrong(prompts, answers) -> a wrong completion (or None) per
    prompt answers the 'policy' kind (None falls back to plus1)."""
    rng = random.Random(seed)
    kinds, weights = zip(*sorted(negatives.items()))
    drawn = rng.choices(kinds, weights, k=len(rows))
    policy = [i for i, k in enumerate(drawn) if k == "policy"]
    sampled = dict(zip(policy, policy_wrong([rows[i]["prompt"] for i in policy], [rows[i]["answer"] for i in policy]))) \
        if policy else {}
    out = []
    for i, (row, kind) in enumerate(zip(rows, drawn)):
        total = int(row["answer"])
        if kind == "policy" and sampled[i] is None:
            kind = "plus1"
        rejected = sampled[i] if kind == "policy" else wrong_answer(rng, total, kind, digits)
        out.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": rejected, "answer": row["answer"],
                    "kind": kind})
    return out


def write_jsonl(path: Path, rows: list[dict]):
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
