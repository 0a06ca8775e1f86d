"""Reward-model training: the GPTModel with a scalar head (model.head=score) learns a Bradley-Terry
preference, -log s(r_chosen - r_rejected - margin), optionally centered (TRL's
center_rewards_coefficient).

Per step: a global batch of pairs (this DP rank's share; a pair never splits), forward/backward
through megatron's schedule, optimizer step. Each sequence's score is read where transformers'
*ForSequenceClassification reads it (the rightmost token that is not the pad token), so an HF
export scores identically; under context parallelism the rank holding that position shares the
score with the others (a straight-through sum). megatron divides the summed pair losses by the
global number of pairs. Every train.eval_every steps (and at the start and end) the same metrics on
the validation pairs, with the accuracy per 'kind' of pair where the rows carry one.
"""

import time
from functools import partial
from pathlib import Path

import torch

from megatron_rl import losses
from megatron_rl.config import Config
from megatron_rl.data import preference
from megatron_rl.data.sft import Batches
from megatron_rl.training.heads import scores_at
from megatron_rl.training.loop import (due, dp_share, finish, save_if_due, schedule_metrics, start_log, train_step,
                                       validation_report)
from megatron_rl.training.setup import build_trainee, load_initial_state, write_run_assets
from megatron_rl.training.step import cp_sum_straight_through, first_cp_rank


def rm_loss(cfg: Config, kinds: list[str], batch: dict, scores: torch.Tensor):
    """(loss numerator, pairs, report) for a microbatch of rows [c0, r0, c1, r1, ...]; scores (2P, S)
    at this context-parallel rank's positions."""
    r = cp_sum_straight_through(scores_at(scores, batch))  # (2P,) every rank holds each score
    chosen, rejected = r[0::2], r[1::2]
    pair_loss = losses.bradley_terry_loss(chosen, rejected, batch["margin"], cfg.algorithm.center_rewards_coefficient)
    once = float(first_cp_rank())  # per-pair numbers count once per context-parallel group
    c, j = chosen.detach(), rejected.detach()
    right = (c > j).float() * once
    report = {"pairs": len(c) * once, "loss_sum": pair_loss.detach().sum() * once, "correct": right.sum(),
              "chosen_sum": c.sum() * once, "rejected_sum": j.sum() * once, "chosen_sq": (c**2).sum() * once,
              "rejected_sq": (j**2).sum() * once}
    for i, kind in enumerate(kinds):
        if kind:
            of_kind = (batch["kind"] == i).float()
            report[f"correct_{kind}"], report[f"pairs_{kind}"] = (right * of_kind).sum(), of_kind.sum() * once
    return pair_loss.sum(), torch.tensor(int(len(c) * once)), report


def metrics_of(r: dict, prefix: str) -> dict:
    pairs = max(r["pairs"], 1)
    out = {"loss": r["loss_sum"] / pairs, "accuracy": r["correct"] / pairs,
           "margin": (r["chosen_sum"] - r["rejected_sum"]) / pairs}
    for side in ("chosen", "rejected"):
        mean = r[f"{side}_sum"] / pairs
        out[f"score_{side}_mean"] = mean
        out[f"score_{side}_std"] = max(r[f"{side}_sq"] / pairs - mean**2, 0.0) ** 0.5
    for key in r:
        if key.startswith("correct_") and r[f"pairs_{key[8:]}"]:
            out[f"accuracy_{key[8:]}"] = r[key] / r[f"pairs_{key[8:]}"]
    return {f"{prefix}/{k}": v for k, v in out.items()}


def evaluate(trainee, cfg: Config, val: dict, kinds: list[str]) -> dict:
    micro = preference.pair_microbatches(dp_share(val), cfg.data.micro_batch_size)
    return metrics_of(validation_report(trainee, micro, partial(rm_loss, cfg, kinds)), "val")


def run(cfg: Config, run_dir: Path) -> dict:
    from megatron.core import parallel_state as ps

    data = preference.prepare(cfg, run_dir)
    trainee = build_trainee(cfg)
    latest, state = load_initial_state(trainee, cfg, run_dir)
    assets = write_run_assets(cfg, run_dir, data.tokenizer)
    step = state["step"] if state else 0
    batches = Batches(data.train, cfg.data.global_batch_size, cfg.data.seed, ps.get_data_parallel_rank(),
                      ps.get_data_parallel_world_size())
    if state:
        batches.load_state_dict(state["extra"]["data"])
    log, prof = start_log(cfg, run_dir, step, latest, trainee)
    log.write(data.note)
    loss_fn = partial(rm_loss, cfg, data.kinds)
    if step == 0 and data.val is not None:
        log.log(0, {**evaluate(trainee, cfg, data.val, data.kinds), **data.truncated()})
    metrics = {}
    while step < cfg.train.max_steps:
        prof.step(step)
        t0 = time.perf_counter()
        with prof.range("train"):
            r, grad_norm = train_step(trainee, preference.pair_microbatches(batches.next(), cfg.data.micro_batch_size),
                                      loss_fn)
        step += 1
        dt = time.perf_counter() - t0
        metrics = {**metrics_of(r, "train"), "train/grad_norm": grad_norm,
                   **schedule_metrics(trainee), "perf/step_time_s": dt,
                   "perf/tokens_per_s": 2 * cfg.data.global_batch_size * cfg.data.seq_length / dt}
        is_last = step == cfg.train.max_steps
        if data.val is not None and due(step, cfg.train.eval_every, is_last):
            with prof.range("eval"):
                metrics.update(evaluate(trainee, cfg, data.val, data.kinds))
        log.log(step, metrics)
        if save_if_due(cfg, trainee, run_dir, step, is_last, batches.state_dict(), assets, log):
            break
    return finish(cfg, trainee, run_dir, assets, log, prof, metrics, plot=["train/loss", "val/accuracy"])
