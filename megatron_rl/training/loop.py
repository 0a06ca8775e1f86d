"""What every algorithm's loop does the same way: its log, the training step, when to evaluate and
save, and how a run ends."""

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.platform import watchdog
from megatron_rl.training.step import forward_backward, optimizer_step, reduce_reports, zero_grads


def due(step: int, every: int, last: bool) -> bool:
    """Whether something done every `every` steps (0: only at the end) happens at `step`."""
    return last or bool(every and step % every == 0)


def start_log(cfg: Config, run_dir: Path, step: int, resumed_from=None, trainee=None):
    """The run's logger (metrics.jsonl, TensorBoard, progress bar on rank 0) and a Profiler."""
    from megatron_rl.logging import RunLogger
    from megatron_rl.profiling import Profiler

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


def train_step(trainee, micro: list[dict], loss_fn) -> tuple[dict, float]:
    """One optimizer step on the gradients of `micro`: (summed report, grad norm)."""
    zero_grads(trainee)
    report = reduce_reports(forward_backward(trainee, micro, loss_fn))
    _, grad_norm = optimizer_step(trainee)
    return report, grad_norm


def schedule_metrics(trainee) -> dict:
    """The learning rate now, and how many optimizer steps were skipped (non-finite) so far."""
    return {"train/lr": trainee.scheduler.get_lr(trainee.optimizer.param_groups[0]),
            "train/skipped_steps": trainee.skipped_steps}


def dp_share(data: dict) -> dict:
    """This data-parallel rank's share of a dict of equally long sequences (every size-th row)."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return {k: v[rank::size] for k, v in data.items()}


def validation_report(trainee, micro: list[dict], loss_fn) -> dict:
    """The summed report of a forward-only pass over `micro` in eval mode (validation)."""
    trainee.eval()
    try:
        with torch.no_grad():
            return reduce_reports(forward_backward(trainee, micro, loss_fn, forward_only=True))
    finally:
        trainee.train()


def save_if_due(cfg: Config, trainee, run_dir: Path, step: int, last: bool, data_state: dict, assets, log,
                before=None) -> bool:
    """Save a checkpoint every checkpoint.save_every steps and at the end (unless checkpoint.save=false);
    before(step) first saves what the checkpoint depends on (PPO's critic). Returns whether the run
    stops here: a preemption signal reached a rank, and it saved first."""
    from megatron_rl import checkpointing, platform

    preempted = not last and platform.preemption_requested()
    if cfg.checkpoint.save and (preempted or due(step, cfg.checkpoint.save_every, last)):
        if before is not None:
            before(step)
        checkpointing.save(trainee, run_dir, step, {"data": data_state}, cfg.checkpoint.keep, model=cfg.model,
                           assets=assets, verify=cfg.checkpoint.verify, lora=cfg.lora)
    if preempted:
        log.write(f"{'interrupted' if platform.interrupted() else 'preempted'}: stopped after step {step}" + (
            ", saved a checkpoint; resume with checkpoint.resume=auto" if cfg.checkpoint.save else ""))
    return preempted


def finish(cfg: Config, trainee, run_dir: Path, assets, log, prof, metrics: dict, plot: list[str] = ()) -> dict:
    """Close the profiling window, export to HF if asked, plot `plot` metrics, print the time per
    phase, close the log; the final metrics (rank 0's)."""
    from megatron_rl.hf import export_hf
    from megatron_rl.logging import plot_metrics

    prof.stop()

    if cfg.checkpoint.export_hf:
        with watchdog.patient("export to HF"):
            log.write(f"wrote {export_hf(trainee.model, cfg.model, run_dir / 'hf', assets=assets, overwrite=True)}")
    if plot and dist.get_rank() == 0:
        log.write(f"plot: {plot_metrics(run_dir, list(plot))}")
    log.write("time per phase (rank 0):\n" + prof.table())
    log.close()
    return log.last if dist.get_rank() == 0 else metrics
