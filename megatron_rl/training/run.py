"""The run scaffold every algorithm's loop stands on.

`Run(cfg, run_dir, tokenizer, data, per_step)` is the prologue: the trainee (model, optimizer,
schedule), the data stream over `data` (`per_step` rows a step over all data-parallel ranks, saved and
restored with each checkpoint), the initial state (a resumed run's checkpoint, or the weights of
checkpoint.load / model.hf_path, or the random init), the assets written beside every checkpoint, and
the log and the profiler (started on first use).

`run.loop(step, validate)` is the rest: per step, the algorithm's `step()` (its phases timed with
`run.phase(name)`), then evaluation every train.eval_every steps and at the end, the log, a checkpoint
every checkpoint.save_every steps and at the end, a stop after a preemption signal (saved first) or
when val/loss stopped improving (algorithm.early_stop_patience), and at the end the HF export, the
plot and the time per phase.
"""

import contextlib
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.platform import watchdog
from megatron_rl.training.setup import build_trainee, load_initial_state, write_run_assets


def check_launch(cfg: Config, run_dir: Path) -> None:
    """What only a run needs, before anything starts: the device supports the settings, the run directory
    holds this run (or none), and W&B can log in."""
    from megatron_rl.checkpointing import check_same_run
    from megatron_rl.platform.support import check_support

    check_support(cfg)
    check_same_run(run_dir, cfg)
    if cfg.logging.wandb_project:
        from megatron_rl.logging import check_wandb_login

        check_wandb_login(cfg.logging.wandb_mode)


def due(step: int, every: int, last: bool) -> bool:
    """Whether something done every `every` steps (0: only at the end) happens at `step`."""
    return last or bool(every and step % every == 0)


def start_log(cfg: Config, run_dir: Path, step: int, resumed_from=None, trainee=None):
    """The run's logger (metrics.jsonl, TensorBoard, W&B, progress bar on rank 0) and a Profiler."""
    from megatron_rl.logging import RunLogger
    from megatron_rl.platform.profiling import Profiler

    g = cfg.logging
    wandb = dict(project=g.wandb_project, name=g.wandb_run or Path(run_dir).name, entity=g.wandb_entity or None,
                 mode=g.wandb_mode or "online", dir=g.wandb_dir or str(run_dir), id=g.wandb_run_id or None,
                 resume=g.wandb_resume or "allow", config=cfg.to_dict()) if g.wandb_project else None
    log = RunLogger(run_dir, cfg.train.max_steps, step, enabled=dist.get_rank() == 0, tensorboard=g.tensorboard,
                    progress=g.progress, desc=cfg.recipe or cfg.algorithm.name, wandb=wandb)
    if resumed_from is not None:
        log.write(f"resumed from {resumed_from} at step {step}")
    if trainee is not None and cfg.lora.rank:
        from megatron_rl.training.lora import parameter_counts
        trainable, total = parameter_counts(trainee.model, cfg.model)
        log.write(f"LoRA (rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g}): {trainable:,} trainable parameters of "
                  f"{total:,} ({100 * trainable / total:.2f}%)")
    return log, Profiler(cfg.profiling, dist.get_rank(), run_dir)


class Run:
    def __init__(self, cfg: Config, run_dir: Path, tokenizer, data: dict, per_step: int):
        from megatron.core import parallel_state as ps

        from megatron_rl.data.batches import Batches

        self.cfg, self.dir = cfg, Path(run_dir)
        self.trainee = build_trainee(cfg)
        self.data = Batches(data, per_step, cfg.data.seed, ps.get_data_parallel_rank(),
                            ps.get_data_parallel_world_size())
        self.resumed_from, state = load_initial_state(self.trainee, cfg, self.dir)
        self.assets = write_run_assets(cfg, self.dir, tokenizer)
        self.step = state["step"] if state else 0  # optimizer steps taken
        if state:
            self.data.load_state_dict(state["extra"]["data"])
        self._log = self._prof = None
        self._best, self._stale = float("inf"), 0  # val/loss, for early stopping

    def _start_log(self):
        """The log and the profiler, started on first use: after what the algorithm builds first (reference,
        engine, scorers), as the loops always started them, so that a refused setup writes no log."""
        if self._log is None:
            self._log, self._prof = start_log(self.cfg, self.dir, self.step, self.resumed_from, self.trainee)

    @property
    def log(self):
        """The run's log: metrics.jsonl, TensorBoard, W&B, the progress bar."""
        self._start_log()
        return self._log

    @property
    def prof(self):
        """The profiler: phase times, nvtx ranges, the capture window."""
        self._start_log()
        return self._prof

    def phase(self, name: str):
        """A phase of the step (rollout, logprob, train ...): timed for perf/time_<name>_s and the table
        at the end, an nvtx range, a range of the torch.profiler trace."""
        return self.prof.range(name)

    def train_time(self, tokens: int) -> dict:
        """perf/step_time_s (this step's train phase) and perf/tokens_per_s for `tokens` tokens a step."""
        seconds = self.prof.last["train"]
        return {"perf/step_time_s": seconds, "perf/tokens_per_s": tokens / seconds}

    def phase_times(self) -> dict:
        """perf/time_<phase>_s of the step now running, for each phase it went through."""
        return {f"perf/time_{name}_s": s for name, s in self.prof.last.items()}

    def loop(self, step, validate=None, validate_first: bool = True, first: dict | None = None, before_save=None,
             plot: list[str] = ()) -> dict:
        """Steps until train.max_steps: step() takes one and returns its metrics; validate() gives the
        val/* metrics (also logged as step 0 before training, with `first`, unless validate_first is false);
        before_save(step) saves what a checkpoint depends on (PPO's critic). Returns the final metrics."""
        cfg, metrics = self.cfg, {}
        if self.step == 0 and validate is not None and validate_first:  # the starting point, logged as step 0
            self.log.log(0, {**validate(), **(first or {})})
        while self.step < cfg.train.max_steps:
            self.prof.step(self.step)
            metrics = step()
            self.step += 1
            last = self.step == cfg.train.max_steps
            if validate is not None and due(self.step, cfg.train.eval_every, last):
                with self.phase("eval"):
                    metrics.update(validate())
            self.log.log(self.step, metrics)
            stop = self._stops_early(metrics)
            if self._save_if_due(last or stop, before_save) or stop:
                break
        return self.finish(metrics, plot)

    def _stops_early(self, metrics: dict) -> bool:
        """Whether val/loss, measured this step, has not improved for algorithm.early_stop_patience evaluations."""
        patience = self.cfg.algorithm.early_stop_patience
        if "val/loss" not in metrics:
            return False
        if metrics["val/loss"] < self._best:
            self._best, self._stale = metrics["val/loss"], 0
        else:
            self._stale += 1
        if patience and self._stale >= patience:
            self.log.write(f"early stop at step {self.step}: val/loss has not improved for {self._stale} evaluations")
            return True
        return False

    def _save_if_due(self, last: bool, before=None) -> bool:
        """Save a checkpoint every checkpoint.save_every steps and at the end (unless checkpoint.save=false);
        before(step) first saves what the checkpoint depends on. Returns whether the run stops here: a
        preemption signal reached a rank, and it saved first."""
        from megatron_rl import checkpointing, platform

        cfg, step = self.cfg, self.step
        preempted = not last and platform.preemption_requested()
        if cfg.checkpoint.save and (preempted or due(step, cfg.checkpoint.save_every, last)):
            if before is not None:
                before(step)
            checkpointing.save(self.trainee, self.dir, step, {"data": self.data.state_dict()}, cfg.checkpoint.keep,
                               model=cfg.model, assets=self.assets, verify=cfg.checkpoint.verify, lora=cfg.lora)
        if preempted:
            self.log.write(f"{'interrupted' if platform.interrupted() else 'preempted'}: stopped after step {step}" + (
                ", saved a checkpoint; resume with checkpoint.resume=auto" if cfg.checkpoint.save else ""))
        return preempted

    def finish(self, metrics: dict, plot: list[str] = ()) -> dict:
        """Close the profiling window, export to HF if asked, plot `plot` metrics, print the time per
        phase, close the log; the final metrics (rank 0's)."""
        from megatron_rl.hf import export_hf
        from megatron_rl.logging import plot_metrics

        self.prof.stop()
        if self.cfg.checkpoint.export_hf:
            with watchdog.patient("export to HF"):
                out = export_hf(self.trainee.model, self.cfg.model, self.dir / "hf", assets=self.assets, overwrite=True)
                self.log.write(f"wrote {out}")
        if plot and dist.get_rank() == 0:
            self.log.write(f"plot: {plot_metrics(self.dir, list(plot))}")
        self.log.write("time per phase (rank 0):\n" + self.prof.table())
        self.log.close()
        return self.log.last if dist.get_rank() == 0 else metrics


@contextlib.contextmanager
def closing_all(*things):
    """Close each of `things` that is not None (scorers, reward-function workers) on the way out, once each."""
    try:
        yield
    finally:
        for thing in {id(t): t for t in things if t is not None}.values():
            thing.close()
