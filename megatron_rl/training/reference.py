"""The reference policy: the frozen initial policy (GRPO's KL penalty, DPO's reference), and its
log-probs computed once and cached (algorithm.precompute_reference)."""

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import Config, ConfigError
from model_providers.builder import unwrap


def build_reference(cfg: Config, trainee, resumed: bool) -> list:
    """Model chunks without DDP or optimizer holding the weights the run started from. A fresh run
    copies the trainee's weights as they are before its first step; a resumed run reloads
    checkpoint.load or model.hf_path. With LoRA adapters the reference is the trainee itself, read
    inside lora.adapters_off (its frozen base: no second copy of the model)."""
    from megatron_rl import checkpointing
    from megatron_rl.hf import import_hf
    from megatron_rl.training.frozen import freeze
    from megatron_rl.training.setup import build_model

    if cfg.lora.rank:
        return trainee.model
    reference, _ = build_model(cfg, wrap_ddp=False)
    if not resumed:
        for ref, chunk in zip(reference, trainee.model):
            unwrap(ref).load_state_dict(unwrap(chunk).state_dict())
    elif cfg.checkpoint.load:
        checkpointing.load_weights(reference, checkpointing.resolve(cfg.checkpoint.load), cfg.model.head)
    elif cfg.model.hf_path:
        import_hf(reference, cfg.model, cfg.model.hf_path)
    else:
        raise ConfigError("a resumed run's reference policy is its initial weights, which a run started from a random "
                          "init does not keep; start such runs from checkpoint.load or model.hf_path.")
    return freeze(reference)


def weight_bytes(chunks: list) -> int:
    """Bytes of this rank's parameters."""
    return sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())


def _files(path: Path) -> list:
    """What identifies a file (its content's hash) or a directory (each file's name, size, mtime)."""
    if path.is_file():
        return [hashlib.sha256(path.read_bytes()).hexdigest()]
    return [(str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(path.rglob("*")) if f.is_file()]


def cache_key(cfg: Config, data_path: Path, tokenizer) -> str:
    """A digest of everything reference log-probs depend on: the data file, the tokenizer, the
    reference weights (checkpoint.load or model.hf_path), the architecture, precision and the
    encoding settings. A change in any of them gives another key, so stale values are never used."""
    from dataclasses import asdict

    from megatron_rl import checkpointing

    source = checkpointing.resolve(cfg.checkpoint.load) if cfg.checkpoint.load else Path(cfg.model.hf_path)
    d = cfg.data
    parts = {"data": _files(Path(data_path)), "reference": [str(source.resolve()), _files(source)],
             "tokenizer": [sorted(tokenizer.get_vocab().items()), tokenizer.all_special_ids,
                           getattr(tokenizer, "chat_template", None)],
             "model": asdict(cfg.model), "precision": cfg.train.precision,
             "encoding": [d.seq_length, d.max_prompt_length, d.max_completion_length, d.truncation_mode]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def cached(path: Path, key: str, compute) -> tuple[torch.Tensor, bool]:
    """The tensor cached at `path` under `key`, else compute() (on every rank) saved there by rank
    0 (written to a temporary file, then renamed). Returns (tensor, whether it came from the cache)."""
    holder = [path.is_file() and torch.load(path, weights_only=True)["key"] == key if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if holder[0]:
        return torch.load(path, weights_only=True)["values"], True
    values = compute()
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"key": key, "values": values}, tmp)
        tmp.replace(path)
    dist.barrier()
    return values, False
