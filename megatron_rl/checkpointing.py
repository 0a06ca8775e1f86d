"""Checkpoints with megatron dist_checkpointing: model, optimizer, schedule, RNG and data position.

Layout: <run_dir>/checkpoints/step_<N>/ (a dist_checkpointing directory). A checkpoint is
complete once rank 0 has written `complete` into it after every rank finished; resume picks the
newest complete one. Tensors are saved in the layout-independent sharded format, so a checkpoint
saved at one TP/PP/DP layout loads at another (resharding). RNG states are per rank and are only
restored when the layout is unchanged.
"""

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

MARKER = "complete"
# The distributed optimizer's state in model-parameter shapes, like the plain optimizer's: it
# loads at any TP/PP/DP layout. (0.16.1's default, 'fully_sharded_model_space', is refused by its
# own ShardedTensor validation: "flattened_range is not supported".)
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / MARKER).exists()) if root.is_dir() else []
    return done[-1] if done else None


def _model_state(model: list) -> dict:
    # Dict paths are local names; dist_checkpointing matches shards by their global keys,
    # so chunks from any virtual-pipeline layout land in the right place.
    return {f"chunk{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _layout() -> tuple[int, ...]:
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
            ps.get_data_parallel_world_size())


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _rng_state():
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
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
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save(trainee, run_dir: str | Path, step: int, extra: dict, keep: int = 0) -> Path:
    """Save everything needed to resume at `step`; `extra` holds plain picklable state (data position)."""
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(run_dir, step)
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    model_state = _model_state(trainee.model)
    state = {
        "model": model_state,
        "optimizer": trainee.optimizer.sharded_state_dict(model_state, metadata=OPTIMIZER_FORMAT),
        "rng": _rng_state(),
        "layout": list(_layout()),
        "distributed_optimizer": _is_distributed(trainee.optimizer),
        "scheduler": trainee.scheduler.state_dict(),
        "step": step,
        "extra": extra,
    }
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (path / MARKER).write_text(str(step))
        _prune(Path(run_dir), keep)
    dist.barrier()
    return path


def _prune(run_dir: Path, keep: int):
    if keep <= 0:
        return
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / MARKER).exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(trainee, path: str | Path, weights_only: bool = False) -> dict:
    """Load a checkpoint into trainee; returns {'step', 'extra'} (empty for weights only)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(
            f"{str(path)!r} is not a complete megatron-rl checkpoint (no '{MARKER}' marker); "
            f"point checkpoint.load at a checkpoints/step_N directory.")
    model_state = _model_state(trainee.model)
    request = {"model": model_state}
    if not weights_only:
        request["optimizer"] = trainee.optimizer.sharded_state_dict(model_state, is_loading=True,
                                                                    metadata=OPTIMIZER_FORMAT)
        request["rng"] = _rng_state()
    common = dist_checkpointing.load_common_state_dict(str(path))
    saved_distributed = common.get("distributed_optimizer", False)
    if not weights_only and saved_distributed != _is_distributed(trainee.optimizer):
        raise ValueError(
            f"checkpoint {str(path)!r} holds {'distributed' if saved_distributed else 'plain'} optimizer "
            f"state; resume with optimizer.distributed={str(saved_distributed).lower()}, or start from its "
            f"weights with a fresh optimizer via checkpoint.load.")
    same_layout = list(common.get("layout", [])) == list(_layout())
    if not same_layout:
        request.pop("rng", None)  # per-rank RNG states only make sense in the same layout
    loaded = dist_checkpointing.load(request, str(path))
    for i, chunk in enumerate(trainee.model):
        unwrap(chunk).load_state_dict(loaded["model"][f"chunk{i}"])
    if weights_only:
        trainee.optimizer.reload_model_params()
        return {}
    trainee.optimizer.load_state_dict(loaded["optimizer"])
    trainee.scheduler.load_state_dict(common["scheduler"])
    if "rng" in loaded:
        _set_rng_state(loaded["rng"])
    return {"step": common["step"], "extra": common["extra"]}
