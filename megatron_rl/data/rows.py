"""Reading data files: JSONL or parquet rows, each remembered with its line so that a bad one is named
(file:line) in the one sentence a user sees; data.on_bad_row=skip drops bad rows and says how many."""

import json
from pathlib import Path

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


def read_rows(path: str | Path, on_bad_row: str = "fail") -> Rows:
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
