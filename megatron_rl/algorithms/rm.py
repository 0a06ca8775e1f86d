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

from functools import partial
from pathlib import Path

import torch

from megatron_rl import losses
from megatron_rl.config import Config
from megatron_rl.data import preference
from megatron_rl.rollout.policy_samples import wrong_answer_sampler
from megatron_rl.training.run import Run
from megatron_rl.training.step import (cp_sum_straight_through, dp_share, first_cp_rank, schedule_metrics, train_step,
                                       validation_report)
from model_providers.heads import scores_at


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
    data = preference.prepare(cfg, run_dir, wrong_answer_sampler)
    run = Run(cfg, run_dir, data.tokenizer, data.train, cfg.data.global_batch_size)
    run.log.write(data.note)
    loss_fn = partial(rm_loss, cfg, data.kinds)

    def step() -> dict:
        with run.phase("train"):
            micro = preference.pair_microbatches(run.data.next(), cfg.data.micro_batch_size)
            r, grad_norm = train_step(run.trainee, micro, loss_fn)
        return {**metrics_of(r, "train"), "train/grad_norm": grad_norm, **schedule_metrics(run.trainee),
                **run.train_time(2 * cfg.data.global_batch_size * cfg.data.seq_length)}  # pairs: two sequences each

    validate = (lambda: evaluate(run.trainee, cfg, data.val, data.kinds)) if data.val is not None else None
    return run.loop(step, validate, first=data.truncated(), plot=["train/loss", "val/accuracy"])
