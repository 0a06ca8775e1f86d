"""A synthetic task the project generates itself: integer addition, 'a+b=' -> 'c'.

Held-out exact match is a clear learning signal: chance is about 10^-digits. With `noise`, that
share of the training demonstrations answers one too many (imperfect demonstrations, as from a
weak model or a hurried annotator); every row's 'answer' and the validation split stay exact, so
a verifiable reward can correct what supervised learning copied.
"""

import json
import random
from pathlib import Path

ALPHABET = "0123456789+="


def make_problem(rng: random.Random, digits: int) -> dict:
    a = rng.randrange(10 ** rng.randint(1, digits))
    b = rng.randrange(10 ** rng.randint(1, digits))
    return {"prompt": f"{a}+{b}=", "response": str(a + b), "answer": str(a + b)}


def write_splits(out_dir: str | Path, num_train: int, num_val: int, digits: int, seed: int,
                 noise: float = 0.0) -> tuple[Path, Path]:
    """Write train.jsonl and val.jsonl with no val prompt also in train; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    val, seen = [], set()
    while len(val) < num_val:
        row = make_problem(rng, digits)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            val.append(row)
    train = []
    while len(train) < num_train:
        row = make_problem(rng, digits)
        if row["prompt"] not in seen:
            if rng.random() < noise:
                row["response"] = str(int(row["answer"]) + 1)
            train.append(row)
    paths = out_dir / "train.jsonl", out_dir / "val.jsonl"
    for path, rows in zip(paths, (train, val)):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return paths
