"""Run outputs on rank 0: metrics.jsonl (one flat object per step), TensorBoard, Weights & Biases, a
progress bar."""

import json
import time
from pathlib import Path

# Shown in the progress bar when present, in this order.
BAR_KEYS = ("train/loss", "val/loss", "val/accuracy", "rollout/reward_mean", "train/lr")


class RunLogger:
    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, enabled: bool = True,
                 tensorboard: bool = True, progress: bool = True, desc: str = "train", wandb: dict | None = None):
        """wandb: wandb.init's project, name, entity, mode and config (None: no W&B)."""
        self.enabled = enabled
        self.last: dict = {}
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = _cut_metrics(self.run_dir / "metrics.jsonl", start_step)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run drops the events a killed run wrote after its checkpoint; a fresh one all
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else 0)
        self.wandb = _start_wandb(self.run_dir, wandb) if wandb else None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step",
                            dynamic_ncols=True, smoothing=0.1)
        self.t0 = time.time()

    def log(self, step: int, metrics: dict):
        """Append one step's metrics (floats) to every sink."""
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.last.update(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self.bar is not None:
            shown = {k.split("/")[-1] if k.startswith("train/") else k: f"{self.last[k]:.4g}"
                     for k in BAR_KEYS if k in self.last}
            self.bar.set_postfix(shown, refresh=False)
            self.bar.n = step
            self.bar.refresh()

    def write(self, message: str):
        if self.enabled:
            if self.bar is not None:
                self.bar.write(message)
            else:
                print(message, flush=True)

    def close(self):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.metrics.close()


def _cut_metrics(path: Path, start_step: int):
    """metrics.jsonl opened for appending from start_step: a run resumed at step S keeps the rows of
    steps up to S (a run killed after its checkpoint logged later steps, which it now logs again);
    a fresh run (S = 0) starts it anew. The cut file replaces the old one atomically."""
    rows = []
    if start_step and path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip() and _step_of(line) <= start_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(row + "\n" for row in rows))
    tmp.replace(path)
    return path.open("a")


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a row cut short by the kill: dropped


def _start_wandb(run_dir: Path, settings: dict):
    """A W&B run for this run directory: unless settings name an id, its id is kept in <run_dir>/wandb_id,
    so a resumed run continues the same W&B run."""
    import uuid

    import wandb

    id_file = run_dir / "wandb_id"
    if not settings.get("id"):
        settings = {**settings, "id": id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]}
    id_file.write_text(settings["id"] + "\n")
    Path(settings["dir"]).mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(**settings)
    except wandb.errors.UsageError as e:
        from megatron_rl.config import ConfigError

        raise ConfigError(f"Weights & Biases refused to start ({e}): {LOGIN_HINT}.") from None


LOGIN_HINT = ("run `wandb login` (or set $WANDB_API_KEY) to log online, or log offline with WANDB_MODE=offline "
              "or logging.wandb_mode=offline")


def check_wandb_login(mode: str):
    """Before a run starts: an online W&B run needs credentials ($WANDB_API_KEY, or what `wandb login` wrote
    to ~/.netrc for the W&B host); without them, one sentence (W&B itself fails with a traceback)."""
    import netrc
    import os
    from urllib.parse import urlparse

    from megatron_rl.config import ConfigError

    if mode not in ("", "online") or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        found = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    if not found:
        raise ConfigError(f"logging to Weights & Biases online needs a login, and there is none for {host}: "
                          f"{LOGIN_HINT}.")


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(run_dir: str | Path, keys: list[str], name: str = "plot.png") -> Path:
    """A PNG with one panel per metric key (value per step) from metrics.jsonl; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o" if len(points) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(run_dir) / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
