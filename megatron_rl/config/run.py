"""The checkpoint, logging and profiling sections: what a run writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class CheckpointConfig:
    save_every: int = 0
    """Save every N steps (and always at the end); 0 means only at the end."""
    resume: bool | Literal["auto"] = False
    """true: continue from the latest complete checkpoint in the run directory (there must be one);
    auto: continue if there is one, else start fresh (a requeued job); false: start fresh."""
    load: str = ""
    """Start from the model weights of this checkpoint directory (any TP/PP layout), or of the
    latest checkpoint of this run directory."""
    save: bool = True
    """Write checkpoints at all (every save_every steps and at the end)."""
    keep: int = 2
    """How many recent checkpoints to keep; 0 keeps all."""
    export_hf: bool = False
    """At the end, also write the model as a Hugging Face directory to <run_dir>/hf."""
    verify: Literal["size", "full"] = "size"
    """What a checkpoint's marker records and resume checks: each file's size (a truncated or missing
    file), or also its SHA-256 (full: any corruption, at the cost of reading every file twice)."""


@dataclass(kw_only=True)
class LoggingConfig:
    run_dir: str = ""
    """Where outputs go; empty means runs/<recipe>."""
    tensorboard: bool = True
    """Write TensorBoard events beside metrics.jsonl."""
    progress: bool = True
    """A progress bar with ETA on the console of rank 0."""
    wandb_project: str = ""
    """Weights & Biases project to log to (empty: $WANDB_PROJECT, else off). Needs `pip install wandb`."""
    wandb_run: str = ""
    """The W&B run's name (empty: the run directory's name)."""
    wandb_entity: str = ""
    """W&B team or user (empty: $WANDB_ENTITY, else your default)."""
    wandb_mode: Literal["", "online", "offline", "disabled"] = ""
    """online, or offline (the run under <wandb_dir>/wandb for a later `wandb sync`); empty: $WANDB_MODE,
    else online."""
    wandb_dir: str = ""
    """Where W&B writes its files (empty: $WANDB_DIR, else the run directory)."""
    wandb_run_id: str = ""
    """The W&B run id (empty: $WANDB_RUN_ID, else one kept in <run_dir>/wandb_id, so a resumed run
    continues the same W&B run)."""
    wandb_resume: Literal["", "allow", "must", "never", "auto"] = ""
    """wandb.init's resume (empty: $WANDB_RESUME, else allow)."""

    def take_environment(self, env) -> list[str]:
        """Fill the W&B fields the config leaves empty from W&B's own environment variables, as every W&B
        user sets them (the config wins where set); returns one line per field taken, naming its source."""
        taken = []
        for name, var in WANDB_ENVIRONMENT.items():
            value = env.get(var, "")
            if not getattr(self, name) and value:
                value = "offline" if (name, value) == ("wandb_mode", "dryrun") else value  # W&B's old name
                setattr(self, name, value)
                taken.append(f"logging.{name}={value} (from ${var})")
        return taken


WANDB_ENVIRONMENT = {"wandb_project": "WANDB_PROJECT", "wandb_entity": "WANDB_ENTITY", "wandb_mode": "WANDB_MODE",
                     "wandb_dir": "WANDB_DIR", "wandb_run_id": "WANDB_RUN_ID", "wandb_resume": "WANDB_RESUME"}


@dataclass(kw_only=True)
class ProfilingConfig:
    nvtx: bool = False
    """Wrap phases in nvtx ranges (for nsys)."""
    nsys_start: int = -1
    """First step of the profiling window: torch.cuda.profiler capture starts there (run under `nsys
    --capture-range=cudaProfilerApi --capture-range-end=stop`), and the torch profiler records."""
    nsys_end: int = -1
    """The step where the window closes (-1: one step after nsys_start)."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """The ranks that profile (the others run unprofiled)."""
    torch_profiler: bool = False
    """Record the window with torch.profiler into <run_dir>/profile/*.pt.trace.json (TensorBoard and
    Chrome/Perfetto open it), on any device; without a window, step 1 (after a warm-up step)."""

    def window(self) -> tuple[int, int]:
        """[start, end) of the profiling window in steps; (-1, -1) when nothing is profiled."""
        start = self.nsys_start if self.nsys_start >= 0 else (1 if self.torch_profiler else -1)
        if start < 0:
            return -1, -1
        return start, self.nsys_end if self.nsys_end > start else start + 1
