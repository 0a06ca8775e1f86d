"""Supervised fine-tuning: cross-entropy on response tokens only.

Per step: take a global batch (this DP rank's slice), forward/backward through megatron's
schedule with the loss normalized by the global count of response tokens, optimizer step.
Every train.eval_every steps: val/loss and val/accuracy (greedy exact match, measured by
teacher forcing: greedy decoding reproduces the reference exactly iff every reference token,
eos included, is the argmax given the reference prefix).
"""

from functools import partial
from pathlib import Path

import torch

from megatron_rl.config import Config
from megatron_rl.data import sft as sft_data
from megatron_rl.data.rows import read_rows, report_skipped
from megatron_rl.data.tasks import data_files
from megatron_rl.training.logprobs import argmax_equals, mask_padded_vocab, token_logprobs
from megatron_rl.training.run import Run
from megatron_rl.training.step import (cp_sum, dp_share, first_cp_rank, make_microbatches, schedule_metrics, train_step,
                                       validation_report)


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
    train_rows, val_rows = read_rows(train_path, skip), read_rows(val_path, skip) if val_path else None
    train = sft_data.encode(train_rows, tokenizer, cfg.data.seq_length)
    val = sft_data.encode(val_rows, tokenizer, cfg.data.seq_length) if val_rows else None
    report_skipped(train_rows, val_rows)
    return tokenizer, train, val


def evaluate(trainee, cfg: Config, val: dict) -> dict:
    micro = make_microbatches(cfg, dp_share(val), cfg.data.micro_batch_size)
    r = validation_report(trainee, micro, partial(sft_loss, cfg.model.vocab_size))
    return {"val/loss": r["loss_sum"] / max(r["tokens"], 1), "val/accuracy": r["correct"] / max(r["samples"], 1)}


def run(cfg: Config, run_dir: Path) -> dict:
    tokenizer, train, val = prepare_data(cfg, run_dir)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = len(tokenizer)
    run = Run(cfg, run_dir, tokenizer, train, cfg.data.global_batch_size)
    loss_fn = partial(sft_loss, cfg.model.vocab_size)
    run.trainee.train()

    def step() -> dict:
        with run.phase("train"):
            micro = make_microbatches(cfg, run.data.next(), cfg.data.micro_batch_size)
            r, grad_norm = train_step(run.trainee, micro, loss_fn)
        return {"train/loss": r["loss_sum"] / max(r["tokens"], 1), "train/accuracy": r["correct"] / max(r["samples"], 1),
                **schedule_metrics(run.trainee), "train/grad_norm": grad_norm,
                **run.train_time(cfg.data.global_batch_size * cfg.data.seq_length)}

    return run.loop(step, (lambda: evaluate(run.trainee, cfg, val)) if val is not None else None, validate_first=False)
