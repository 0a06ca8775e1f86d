"""Hugging Face checkpoint directories: read tensors one at a time, write safetensors shards + index."""

import json
import os
import shutil
from pathlib import Path

import torch

from megatron_rl.config import ConfigError

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
ASSET_MAX_BYTES = 64 << 20
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # tokenizer and config files are small; anything bigger is not an asset


class HFCheckpoint:
    """The config and weights of an HF model directory, read lazily, one tensor at a time."""

    def __init__(self, path: str | Path, allow_pickle: bool = False):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConfigError(f"{str(self.path)!r} is not a Hugging Face model directory (no config.json).")
        self.config = json.loads((self.path / "config.json").read_text())
        self.allow_pickle = allow_pickle
        self._open: dict[str, object] = {}  # file name -> open safetensors handle or loaded .bin dict
        self.weight_map = self._weight_map()  # tensor name -> file name

    def _weight_map(self) -> dict[str, str]:
        p = self.path
        if (p / SAFE_INDEX).is_file():
            return self._checked(json.loads((p / SAFE_INDEX).read_text())["weight_map"])
        if (p / "model.safetensors").is_file():
            return {name: "model.safetensors" for name in self._safe_keys("model.safetensors")}
        if (p / BIN_INDEX).is_file() or (p / "pytorch_model.bin").is_file():
            if not self.allow_pickle:
                raise ConfigError(f"{str(p)!r} holds pickled .bin weights, which can run code when loaded; "
                                  f"convert them to safetensors, or pass --allow-pickle if you trust the source.")
            if (p / BIN_INDEX).is_file():
                return self._checked(json.loads((p / BIN_INDEX).read_text())["weight_map"])
            return {name: "pytorch_model.bin" for name in self._bin("pytorch_model.bin")}
        raise ConfigError(f"no weights in {str(p)!r}: expected model.safetensors, {SAFE_INDEX} or pytorch_model.bin.")

    def _checked(self, weight_map: dict) -> dict:
        missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
        if missing:
            raise ConfigError(f"{str(self.path)!r}: the index lists shard(s) that are missing: {', '.join(missing[:5])}.")
        return weight_map

    def _safe_keys(self, file: str) -> list[str]:
        return list(self._file(file).keys())

    def _bin(self, file: str) -> dict:
        if file not in self._open:
            self._open[file] = torch.load(self.path / file, map_location="cpu", weights_only=True, mmap=True)
        return self._open[file]

    def _file(self, file: str):
        if file.endswith(".bin"):
            return self._bin(file)
        if file not in self._open:
            from safetensors import safe_open

            try:
                self._open[file] = safe_open(str(self.path / file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers/sizes
                raise ConfigError(f"{str(self.path / file)!r} is truncated or not a safetensors file ({e}).") from None
        return self._open[file]

    def names(self) -> set[str]:
        return set(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ConfigError(f"{str(self.path)!r} has no tensor {name!r}, which its config.json implies; "
                              f"the config does not match the weights.")
        file = self.weight_map[name]
        f = self._file(file)
        if isinstance(f, dict):
            return f[name]
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise ConfigError(f"cannot read {name!r} from {str(self.path / file)!r}: the file is truncated or "
                              f"corrupt ({e}).") from None

    def dtype_of(self, name: str) -> torch.dtype:
        """A tensor's stored dtype, read from the file header (no data is loaded)."""
        f = self._file(self.weight_map[name])
        if isinstance(f, dict):
            return f[name].dtype
        return _SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()]


def copy_assets(src: str | Path, dst: str | Path):
    """Copy an HF directory's small non-weight files (config, generation config, tokenizer files)."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if (f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name not in (SAFE_INDEX, BIN_INDEX)
                and f.stat().st_size <= ASSET_MAX_BYTES):
            shutil.copy2(f, dst / f.name)


class ShardWriter:
    """Collects HF tensors and writes them as safetensors files of at most `max_bytes` each.

    Every writing rank has its own writer; `finish_index` (rank 0, after all have closed) names the
    files model-0000i-of-0000N.safetensors and writes the index.
    """

    def __init__(self, out_dir: str | Path, rank: int, max_bytes: int):
        self.out_dir, self.rank, self.max_bytes = Path(out_dir), rank, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str], int]] = []  # (file, names, bytes)

    def add(self, name: str, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().contiguous().clone()  # no shared storage in a file
        self.pending_bytes += size

    def flush(self):
        if not self.pending:
            return
        from safetensors.torch import save_file

        file = f"part-rank{self.rank:05d}-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.out_dir / file), metadata={"format": "pt"})
        self.files.append((file, sorted(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[tuple[str, list[str], int]]:
        self.flush()
        return self.files


def finish_index(out_dir: str | Path, files: list[tuple[str, list[str], int]]):
    """Rename the parts to HF's shard names and write model.safetensors.index.json."""
    out_dir = Path(out_dir)
    n = len(files)
    weight_map, total = {}, 0
    for i, (part, names, size) in enumerate(files, 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(out_dir / part, out_dir / final)
        weight_map.update({name: final for name in names})
        total += size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
