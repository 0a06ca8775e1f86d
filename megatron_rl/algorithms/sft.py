"""Supervised fine-tuning: cross-entropy on response tokens only.

Per step: take a global batch (this DP rank's slice), forward/backward through megatron's
schedule with the loss normalized by the global count of response tokens, optimizer step.
Every train.eval_every steps: val/loss and val/accuracy (greedy exact match, measured by
teacher forcing: greedy decoding reproduces the reference exactly iff every reference token,
eos included, is the argmax given the reference prefix).
"""

import time
from pathlib import Path

import torch

from megatron_rl.config import Config
from megatron_rl.data import sft as sft_data
from megatron_rl.data.tasks import data_files
from megatron_rl.training.logprobs import argmax_equals, mask_padded_vocab, token_logprobs
from megatron_rl.training.loop import (due, dp_share, finish, save_if_due, schedule_metrics, start_log, train_step,
                                       validation_report)
from megatron_rl.training.setup import build_trainee, load_initial_state, write_run_assets
from megatron_rl.training.step import cp_sum, first_cp_rank, make_microbatches


def sft_loss(vocab_size: int, batch: dict, logits: torch.Tensor):
    """(sum of response-token NLL, response-token count, report) for one microbatch."""
    logits = mask_padded_vocab(logits, vocab_size)  # (B, S, V/tp)
    mask = batch["loss_mask"]
    hit = argmax_equals(logits.detach(), batch["labels"]) | (mask == 0)  # (B, S), before logits are overwritten
    nll = -token_logprobs(logits, batch["labels"])  # (B, S)
    loss_sum = (nll * mask).sum()
    tokens = mask.sum()
    wrong = cp_sum((~hit).sum(dim=1))  # per sample, over the whole sequence (context parallel)
    counts = first_cp_rank()  # per-sample numbers count once per context-parallel group
    report = {"loss_sum": loss_sum.detach(), "tokens": tokens, "correct": (wrong == 0).sum() * counts,
              "samples": torch.tensor(float(len(mask) * counts))}
    return loss_sum, tokens.int(), report


def prepare_data(cfg: Config, run_dir: Path):
    """Tokenizer and encoded train/val tensors."""
    tokenizer, train_path, val_path = data_files(cfg, run_dir)
    skip = cfg.data.on_bad_row
    train_rows, val_rows = sft_data.read_jsonl(train_path, skip), sft_data.read_jsonl(val_path, skip) if val_path else None
    train = sft_data.encode(train_rows, tokenizer, cfg.data.seq_length)
    val = sft_data.encode(val_rows, tokenizer, cfg.data.seq_length) if val_rows else None
    sft_data.report_skipped(train_rows, val_rows)
    return tokenizer, train, val


def evaluate(trainee, cfg: Config, val: dict) -> dict:
    from functools import partial

    micro = make_microbatches(cfg, dp_share(val), cfg.data.micro_batch_size)
    r = validation_report(trainee, micro, partial(sft_loss, cfg.model.vocab_size))
    return {"val/loss": r["loss_sum"] / max(r["tokens"], 1), "val/accuracy": r["correct"] / max(r["samples"], 1)}


def run(cfg: Config, run_dir: Path) -> dict:
    from functools import partial

    from megatron.core import parallel_state as ps

    tokenizer, train, val = prepare_data(cfg, run_dir)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = len(tokenizer)
    trainee = build_trainee(cfg)
    batches = sft_data.Batches(train, cfg.data.global_batch_size, cfg.data.seed,
                               ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    latest, state = load_initial_state(trainee, cfg, run_dir)
    assets = write_run_assets(cfg, run_dir, tokenizer)
    step = state["step"] if state else 0
    if state:
        batches.load_state_dict(state["extra"]["data"])

    log, prof = start_log(cfg, run_dir, step, latest, trainee)
    loss_fn = partial(sft_loss, cfg.model.vocab_size)
    best, stale, metrics = float("inf"), 0, {}
    trainee.train()
    while step < cfg.train.max_steps:
        prof.step(step)
        t0 = time.perf_counter()
        with prof.range("train"):
            r, grad_norm = train_step(trainee, make_microbatches(cfg, batches.next(), cfg.data.micro_batch_size), loss_fn)
        step += 1
        dt = time.perf_counter() - t0
        metrics = {"train/loss": r["loss_sum"] / max(r["tokens"], 1),
                   "train/accuracy": r["correct"] / max(r["samples"], 1),
                   **schedule_metrics(trainee),
                   "train/grad_norm": grad_norm, "perf/step_time_s": dt,
                   "perf/tokens_per_s": cfg.data.global_batch_size * cfg.data.seq_length / dt}
        is_last = step == cfg.train.max_steps
        if val is not None and due(step, cfg.train.eval_every, is_last):
            with prof.range("eval"):
                metrics.update(evaluate(trainee, cfg, val))
            if metrics["val/loss"] < best:
                best, stale = metrics["val/loss"], 0
            else:
                stale += 1
        log.log(step, metrics)
        stop = cfg.algorithm.early_stop_patience and stale >= cfg.algorithm.early_stop_patience
        if stop:
            log.write(f"early stop at step {step}: val/loss has not improved for {stale} evaluations")
        if save_if_due(cfg, trainee, run_dir, step, is_last or stop, batches.state_dict(), assets, log) or stop:
            break
    return finish(cfg, trainee, run_dir, assets, log, prof, metrics)
