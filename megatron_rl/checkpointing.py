"""Checkpoints with megatron dist_checkpointing: model, optimizer, schedule, RNG and data position.

Layout: <run_dir>/checkpoints/step_<N>/ (a dist_checkpointing directory). Every rank writes into a
temporary sibling, .step_<N>.partial; rank 0 then fsyncs the files, writes the `complete` marker
(each file's size, and its SHA-256 with checkpoint.verify=full), renames the directory into place
and points checkpoints/latest at it. So a step_<N> directory is always whole: a run killed while
saving leaves only a .partial directory, which the next save removes. Resume picks the newest
checkpoint whose files match its marker, warning about any damaged one it passes over. Rotation
(checkpoint.keep) renames an old checkpoint out of the step_* names before deleting its files, after
the new one is in place.
Tensors are saved in the layout-independent sharded format, so a checkpoint saved at one TP/PP/DP
layout loads at another (resharding). RNG states are per rank and are only restored when the layout
is unchanged.
"""

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, UserError
from megatron_rl import platform
from megatron_rl.platform.job import RunStopped
from model_providers.builder import is_adapter, unwrap

MARKER = "complete"  # JSON: {"step": N, "files": {relative path: bytes}, "sha256": {...} with verify=full}
LATEST = "latest"  # checkpoints/latest: the name of the newest checkpoint
ASSETS = "hf"  # HF files kept with a checkpoint: tokenizer, HF config (see megatron_rl/hf)
# The distributed optimizer's state in model-parameter shapes, like the plain optimizer's: it
# loads at any TP/PP/DP layout. (0.16.1's default, 'fully_sharded_model_space', is refused by its
# own ShardedTensor validation: "flattened_range is not supported".)
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def latest_checkpoint(run_dir: str | Path, verify: str = "size") -> Path | None:
    """The newest checkpoint of a run directory whose files match its marker; damaged newer ones are
    passed over with a warning."""
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / MARKER).exists()) if root.is_dir() else []
    for path in reversed(done):
        problem = damage(path, verify)
        if problem is None:
            return path
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"warning: passing over checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    return None


def _files(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file() and f.name != MARKER)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _marker(path: Path) -> dict:
    """A checkpoint's completion marker ({} if unreadable, or of a version that recorded nothing)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def damage(path: Path, verify: str = "size") -> str | None:
    """What is wrong with a checkpoint's files against its marker (a missing or truncated file; with
    verify='full' also changed contents), or None. Markers of older versions list no files."""
    marker = _marker(path)
    for name, size in marker.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, its marker recorded {size} (truncated or overwritten)"
        if verify == "full" and name in marker.get("sha256", {}) and _sha256(file) != marker["sha256"][name]:
            return f"{name} does not match its recorded SHA-256 (corrupted)"
    return None


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_file(path: Path, text: str):
    """Write `text` to `path` atomically: a temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def _remove(path: Path):
    """Remove a checkpoint: renamed out of the step_* names first (durably, in one step), so a crash
    while its files are deleted leaves no step directory, complete-looking or not; the next prune
    sweeps what is left of it."""
    trash = path.with_name(f".{path.name}.removing")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    _fsync(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _publish(tmp: Path, path: Path, step: int, verify: str):
    """Make the fully written `tmp` the checkpoint `path` (rank 0)."""
    files = _files(tmp)
    for f in files:
        _fsync(f)
    marker = {"step": step, "files": {str(f.relative_to(tmp)): f.stat().st_size for f in files}}
    if verify == "full":
        marker["sha256"] = {str(f.relative_to(tmp)): _sha256(f) for f in files}
    _replace_file(tmp / MARKER, json.dumps(marker, indent=1))
    for d in {f.parent for f in files} | {tmp}:
        _fsync(d)
    if path.exists():  # the same step saved again (a rerun from an earlier checkpoint)
        _remove(path)
    os.replace(tmp, path)
    _fsync(path.parent)


def _model_state(model: list, adapters_only: bool = False) -> dict:
    # Dict paths are local names; dist_checkpointing matches shards by their global keys,
    # so chunks from any virtual-pipeline layout land in the right place.
    return {f"chunk{i}": {k: v for k, v in unwrap(chunk).sharded_state_dict().items()
                          if is_adapter(k) or not adapters_only} for i, chunk in enumerate(model)}


def _layout() -> tuple[int, ...]:
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
            ps.get_data_parallel_world_size())


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    layer_wise = hasattr(optimizer, "allgather_params")  # megatron's layer-wise optimizer (Muon's distributed)
    return layer_wise or any(isinstance(o, DistributedOptimizer)
                             for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _rng_state():
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    state.update(platform.device_rng_state())
    pp, tp, dp = _layout()
    rank = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank())
    return ShardedObject("rng_state", state, (pp, tp, dp), rank, replica_id=0)


def _set_rng_state(state: dict):
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    platform.set_device_rng_state(state)
    get_cuda_rng_tracker().set_states(state["tracker"])


class CheckpointError(UserError, FileNotFoundError):
    """A checkpoint (or run directory) that is missing, incomplete or damaged; the message names it."""


class SaveFailed(RunStopped):
    """A checkpoint could not be written (a full disk): the run stops, its previous checkpoint intact."""


def _no_space(error: BaseException | None, where: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC or EDQUOT in the error's chain, or (torch's zip
    writer reports a short write only as "unexpected pos") under 64 MiB left on the device."""
    if shutil.disk_usage(where).free < 64 * 2**20:
        return True
    errors = [error]
    while errors:
        error = errors.pop()
        if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(error):
            return True
        errors += [e for e in (error.__cause__, error.__context__, *getattr(error, "failures", {}).values()) if e]
    return False


def _write(path: Path, state: dict, assets: str | Path | None, verify: str = "size"):
    """dist_checkpointing.save of `state` into a temporary sibling of `path`, the HF assets
    (tokenizer, HF config) into its hf/, then published as `path` once every rank is done. A full
    disk on any rank raises SaveFailed on every rank and leaves no trace."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    from megatron_rl.hf.files import copy_assets
    from megatron_rl.platform import watchdog

    tmp = path.with_name(f".{path.name}.partial")
    if dist.get_rank() == 0:
        if tmp.exists():  # left by a run killed while saving
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    error = None
    try:
        with watchdog.patient("checkpoint save"):
            dist_checkpointing.save(state, str(tmp))
    except (Exception, CheckpointException) as e:  # decided below, on every rank together
        error = e
    if not platform.any_rank(error is not None) and dist.get_rank() == 0:
        try:
            if assets:
                copy_assets(assets, tmp / ASSETS)
            _publish(tmp, path, state.get("step", 0), verify)
        except OSError as e:
            error = e
    if platform.any_rank(error is not None):
        no_space = platform.any_rank(error is not None and _no_space(error, path.parent))
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not no_space:
            raise error or RuntimeError(f"another rank failed to write {path.name}; its error says why")
        free = shutil.disk_usage(path.parent).free / 2**20
        raise SaveFailed(f"no space left on the device of {path.parent} to save {path.name} ({free:.0f} MiB free once "
                         "the attempt was removed); the checkpoints before it are intact: free space or lower "
                         "checkpoint.keep, then resume with checkpoint.resume=auto.")
    dist.barrier()


def _warn_if_short_of_space(run_dir: Path):
    """Rank 0, before a save: a warning when the free space is below the size of the newest checkpoint
    (as its marker recorded it)."""
    root = run_dir / "checkpoints"
    published = sorted(root.glob("step_*")) if root.is_dir() else []
    if not published:
        return
    size = sum(v for v in _marker(published[-1]).get("files", {}).values() if isinstance(v, int))
    free = shutil.disk_usage(root).free
    if free < size:
        print(f"warning: {free / 2**20:.1f} MiB free in {root}, less than the last checkpoint's "
              f"{size / 2**20:.1f} MiB: the next save may fail", file=sys.stderr, flush=True)


def save(trainee, run_dir: str | Path, step: int, extra: dict, keep: int = 0, model=None,
         assets: str | Path | None = None, verify: str = "size", lora=None) -> Path:
    """Save everything needed to resume at `step`; `extra` holds plain picklable state (data
    position), `model` the ModelConfig (so tools can rebuild the model), `assets` a directory of
    HF files (tokenizer, config) that an HF export of this checkpoint needs, `lora` the LoRAConfig of a
    model with adapters."""
    path = checkpoint_dir(run_dir, step)
    if dist.get_rank() == 0:
        _warn_if_short_of_space(Path(run_dir))
    model_state = _model_state(trainee.model, adapters_only=lora_settings(lora) is not None)
    _write(path, {
        "model": model_state,
        "optimizer": trainee.optimizer.sharded_state_dict(model_state, metadata=OPTIMIZER_FORMAT),
        "rng": _rng_state(),
        "layout": list(_layout()),
        "distributed_optimizer": _is_distributed(trainee.optimizer),
        "scheduler": trainee.scheduler.state_dict(),
        "step": step,
        "extra": extra,
        "model_config": dataclasses.asdict(model) if model is not None else None,
        "lora": lora_settings(lora) and {**lora_settings(lora), "base": trainee.base},
    }, assets, verify)
    if dist.get_rank() == 0:
        _replace_file(path.parent / LATEST, path.name + "\n")
        _prune(Path(run_dir), keep)
    dist.barrier()
    return path


def save_weights(model_chunks: list, path: str | Path, model, assets: str | Path | None = None) -> Path:
    """A weights-only checkpoint (what HF import writes); loads with checkpoint.load."""
    path = Path(path)
    _write(path, {"model": _model_state(model_chunks), "layout": list(_layout()), "step": 0,
                  "model_config": dataclasses.asdict(model)}, assets)
    return path


def read_model_config(path: str | Path):
    """The ModelConfig a checkpoint was saved with."""
    from megatron.core import dist_checkpointing

    from megatron_rl.config import ModelConfig

    _require_complete(Path(path))
    saved = dist_checkpointing.load_common_state_dict(str(path)).get("model_config")
    if saved is None:
        raise CheckpointError(f"checkpoint {str(path)!r} does not record its model config (saved by an older version).")
    return ModelConfig(**saved)


def _prune(run_dir: Path, keep: int):
    for trash in (run_dir / "checkpoints").glob(".step_*.removing"):  # left by a run killed while removing
        shutil.rmtree(trash, ignore_errors=True)
    if keep <= 0:
        return
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / MARKER).exists())
    for old in done[:-keep]:
        _remove(old)


def is_ours(path: str | Path) -> bool:
    """Whether `path` is one of our checkpoints or a run directory holding them (else, say, an HF
    directory; a run directory also has a config.json, ours)."""
    path = Path(path)
    return (path / MARKER).exists() or (path / "checkpoints").is_dir()


def resolve(path: str | Path) -> Path:
    """The one rule of every place that takes a checkpoint (checkpoint.load, rewards.model, distill.teacher
    and teachers, ppo.critic's start, tools/eval.py --checkpoint, tools/convert_checkpoint.py export): a
    complete checkpoint directory, or a run directory standing for its latest complete one, which rank 0
    names on stdout (once per run directory)."""
    path = Path(path)
    if not (path / MARKER).exists() and (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"run directory {str(path)!r} holds no complete checkpoint yet; train it further "
                                    f"or point at another run or a checkpoints/step_N directory.")
        if path not in _NAMED and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"{path}: its latest complete checkpoint, {latest.name}", flush=True)
        _NAMED.add(path)
        return latest
    _require_complete(path)
    return path


_NAMED: set[Path] = set()  # run directories resolve() has named


def _require_complete(path: Path):
    if not path.exists():
        near = sorted(p.name for p in path.parent.glob("step_*")) if path.parent.is_dir() else []
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist" + (
            f"; {path.parent} holds {', '.join(near[-3:])}" if near else "") + ".")
    if not (path / MARKER).exists():
        raise CheckpointError(
            f"{str(path)!r} is not a complete megatron-rl checkpoint (no '{MARKER}' marker); "
            f"give a run directory or one of its checkpoints/step_N directories.")
    problem = damage(path)
    if problem:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {problem}; load an earlier checkpoint "
                                "(checkpoint.resume passes over damaged ones).")


def architecture_diff(saved: dict, model) -> list[str]:
    """'field=saved (yours: ours)' for each architecture field in which `saved` differs from `model`."""
    ours = dataclasses.asdict(model)
    return [f"{k}={saved[k]!r} (yours: {ours[k]!r})" for k in saved
            if k in ours and k not in model.TRAINING_CHOICES and saved[k] != ours[k]
            and not (k == "vocab_size" and ours[k] == 0)]  # 0: the tokenizer's, known once it loads


def check_same_run(run_dir: str | Path, cfg):
    """Refuse a run directory that holds another run (its config.json names another recipe, algorithm
    or model architecture) rather than mix the two; other settings (the learning rate...) may change."""
    import json


    path = Path(run_dir) / "config.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    other = [f"{what}={theirs!r} (yours: {ours!r})" for what, theirs, ours in (
        ("recipe", saved.get("recipe"), cfg.recipe),
        ("algorithm.name", saved.get("algorithm", {}).get("name"), cfg.algorithm.name)) if theirs != ours]
    other += [f"model.{d}" for d in architecture_diff(saved.get("model", {}), cfg.model)]
    if other:
        raise ConfigError(f"{run_dir} holds another run: {', '.join(other[:3])}; choose another logging.run_dir, or "
                          "delete that directory to start over.")


def check_model_matches(path: str | Path, model):
    """Refuse, naming the fields, a checkpoint whose architecture differs from `model`."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(str(path)).get("model_config")
    if saved is None:
        return
    diff = architecture_diff(saved, model)
    if diff:
        raise ConfigError(f"checkpoint {str(path)!r} holds a different model: model.{', model.'.join(diff[:4])}; "
                         f"set those model.* fields to match.")


def saved_head(path: str | Path) -> str:
    """The head a checkpoint's model has: 'lm' (vocabulary) or 'score' (a reward model)."""
    from megatron.core import dist_checkpointing

    return (dist_checkpointing.load_common_state_dict(str(path)).get("model_config") or {}).get("head", "lm")


def lora_settings(lora) -> dict | None:
    """What shapes a model's LoRA adapters (None: no adapters)."""
    if lora is None or not lora.rank:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}


def saved_lora(path: str | Path) -> dict | None:
    """The LoRA settings of a checkpoint's adapters (None: it has none)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(resolve(path))).get("lora")


def load_weights(model_chunks: list, path: str | Path, head: str = "lm", lora=None) -> bool:
    """Load only the model weights of a checkpoint (any TP/PP/EP layout) into model_chunks, whose
    model has `head` (and LoRA adapters as `lora` says). A reward model (head 'score') loading a
    language model's checkpoint keeps its fresh score head; the reverse is refused. A LoRA checkpoint
    holds adapters alone: the caller loads its base first. Returns whether it was one."""
    from megatron.core import dist_checkpointing

    from model_providers.heads import starts_fresh

    _require_complete(Path(path))
    fresh = starts_fresh(saved_head(path), head, f"checkpoint {str(path)!r}")
    saved_adapters = {k: v for k, v in (saved_lora(path) or {}).items() if k != "base"}
    if saved_adapters and saved_adapters != lora_settings(lora):
        shown = " ".join(f"lora.{k}={','.join(v) if isinstance(v, list) else v}" for k, v in saved_adapters.items())
        raise ConfigError(f"checkpoint {str(path)!r} holds LoRA adapters: continue from it with {shown} (its adapters "
                         f"are merged into the base first).")

    def kept(k):  # a LoRA checkpoint holds its adapters alone (the caller loaded its base); a fresh score
        # head, and adapters the checkpoint does not have, keep their values
        return is_adapter(k) if saved_adapters else not (fresh and k.startswith("score_head.")) and not is_adapter(k)

    state = {c: {k: v for k, v in sd.items() if kept(k)} for c, sd in _model_state(model_chunks).items()}
    loaded = dist_checkpointing.load({"model": state}, str(path))
    for i, chunk in enumerate(model_chunks):
        weights = loaded["model"][f"chunk{i}"]
        weights.update({k: v for k, v in unwrap(chunk).state_dict().items() if not kept(k)})
        unwrap(chunk).load_state_dict(weights)
    return bool(saved_adapters)


def load(trainee, path: str | Path) -> dict:
    """Load a checkpoint into trainee to resume it; returns {'step', 'extra'}."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    _require_complete(path)
    common = dist_checkpointing.load_common_state_dict(str(path))
    adapters_only = common.get("lora") is not None
    model_state = _model_state(trainee.model, adapters_only)
    request = {"model": model_state,
               "optimizer": trainee.optimizer.sharded_state_dict(model_state, is_loading=True,
                                                                 metadata=OPTIMIZER_FORMAT),
               "rng": _rng_state()}
    saved_distributed = common.get("distributed_optimizer", False)
    if saved_distributed != _is_distributed(trainee.optimizer):
        raise ConfigError(
            f"checkpoint {str(path)!r} holds {'distributed' if saved_distributed else 'plain'} optimizer "
            f"state; resume with optimizer.distributed={str(saved_distributed).lower()}, or start from its "
            f"weights with a fresh optimizer via checkpoint.load.")
    if list(common.get("layout", [])) != list(_layout()):
        request.pop("rng")  # per-rank RNG states only make sense in the same layout
    loaded = dist_checkpointing.load(request, str(path))
    for i, chunk in enumerate(trainee.model):
        base = unwrap(chunk).state_dict() if adapters_only else {}  # loaded before, by load_base
        unwrap(chunk).load_state_dict({**base, **loaded["model"][f"chunk{i}"]})
    trainee.optimizer.load_state_dict(loaded["optimizer"])
    trainee.scheduler.load_state_dict(common["scheduler"])
    if "rng" in loaded:
        _set_rng_state(loaded["rng"])
    return {"step": common["step"], "extra": common["extra"]}
