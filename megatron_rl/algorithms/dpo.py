"""Direct preference optimization: DPO's sigmoid loss, IPO and hinge on pairs of responses, with an
optional SFT term on the chosen ones (TRL's rpo_alpha).

Per step: a global batch of pairs (this DP rank's share; a pair never splits), the reference's log-
probs of each response (the frozen initial policy each step, or all of them once before training:
algorithm.precompute_reference), then forward/backward through megatron's schedule and an optimizer
step. A response's log-ratio to the reference, delta = sum_t (log pi - log pi_ref) over its tokens,
is whole on every context-parallel rank (a straight-through sum), so the loss sees whole pairs at
any layout. megatron divides the summed pair losses by the global number of pairs; the SFT term is
pre-scaled by (global pairs / global chosen tokens), making it the mean NLL per chosen token.
Every train.eval_every steps (and at the start and end): the same metrics on the validation pairs
and, where the rows carry an 'answer', val/accuracy by greedy decoding with the rollout engine.
"""

import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import losses
from megatron_rl.config import Config
from megatron_rl.data import preference
from megatron_rl.environments.rewards import build_scorer
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.evaluate import greedy_eval
from megatron_rl.rollout.policy_samples import wrong_answer_sampler
from megatron_rl.training.logprobs import mask_padded_vocab, token_logprobs
from megatron_rl.training.lora import adapters_off
from megatron_rl.training.reference import build_reference, cache_key, cached, weight_bytes
from megatron_rl.training.run import Run, closing_all
from megatron_rl.training.setup import compute_dtype
from megatron_rl.training.step import (cp_sum, cp_sum_straight_through, dp_share, first_cp_rank, forward_only,
                                       make_microbatches, schedule_metrics, share_with_pipeline, train_step,
                                       validation_report)


def dpo_loss(cfg: Config, sft_scale: float, batch: dict, logits: torch.Tensor):
    """(loss numerator, pairs, report) for a microbatch of rows [c0, r0, c1, r1, ...]."""
    a = cfg.algorithm
    mask = batch["loss_mask"]  # (2P, S) this context-parallel rank's positions
    logp = token_logprobs(mask_padded_vocab(logits, cfg.model.vocab_size), batch["labels"])
    logps = cp_sum_straight_through(losses.masked_sum_rows(logp, mask))  # (2P,) whole responses
    delta = logps - batch["ref_logps"]
    if average_logprobs(a):
        delta = delta / cp_sum(mask.sum(dim=1)).clamp(min=1)
    chosen, rejected = delta[0::2], delta[1::2]
    pair_loss = losses.preference_loss(chosen, rejected, a.beta, a.preference_loss, a.label_smoothing)
    nll = -losses.masked_sum(logp[0::2], mask[0::2])  # this rank's chosen tokens (sums over CP like over DP)
    numerator = pair_loss.sum() + (a.sft_loss_weight * sft_scale * nll if a.sft_loss_weight else 0.0)
    once = float(first_cp_rank())  # per-pair numbers count once per context-parallel group
    d = delta.detach()
    report = {"pairs": len(pair_loss) * once, "pref_sum": pair_loss.detach().sum() * once,
              "correct": (d[0::2] > d[1::2]).sum() * once, "reward_chosen": a.beta * d[0::2].sum() * once,
              "reward_rejected": a.beta * d[1::2].sum() * once, "logps_chosen": logps.detach()[0::2].sum() * once,
              "logps_rejected": logps.detach()[1::2].sum() * once, "nll_sum": nll.detach(),
              "chosen_tokens": mask[0::2].sum()}
    return numerator, torch.tensor(int(len(pair_loss) * once)), report


def average_logprobs(a) -> bool:
    """algorithm.average_logprobs, unset meaning true for IPO (defined on per-token means) only."""
    return a.preference_loss == "ipo" if a.average_logprobs is None else a.average_logprobs


def metrics_of(r: dict, prefix: str, sft_loss_weight: float) -> dict:
    pairs = max(r["pairs"], 1)
    pref, sft = r["pref_sum"] / pairs, r["nll_sum"] / max(r["chosen_tokens"], 1)
    out = {"loss": pref + sft_loss_weight * sft, "preference_loss": pref, "sft_loss": sft,
           "preference_accuracy": r["correct"] / pairs, "reward_chosen": r["reward_chosen"] / pairs,
           "reward_rejected": r["reward_rejected"] / pairs,
           "margin": (r["reward_chosen"] - r["reward_rejected"]) / pairs,
           "logps_chosen": r["logps_chosen"] / pairs, "logps_rejected": r["logps_rejected"] / pairs}
    return {f"{prefix}/{k}": v for k, v in out.items()}


def dpo_microbatches(cfg: Config, batch: dict) -> list[dict]:
    """This rank's pairs as microbatches of rows [c0, r0, c1, r1, ...], a pair never split (packed
    under data.max_tokens_per_microbatch when set)."""
    return make_microbatches(cfg, batch, cfg.data.micro_batch_size, flatten=preference.flatten_pairs)


def reference_logps(model_chunks: list, batch: dict, cfg: Config) -> torch.Tensor:
    """The summed response log-probs (N, 2) of this rank's pairs under `model_chunks`, on every rank."""
    out = torch.zeros(len(batch["tokens"]), 2)

    def collect(mb, logits):
        lp = token_logprobs(mask_padded_vocab(logits, cfg.model.vocab_size), mb["labels"])
        out[mb["index"].cpu()] = losses.masked_sum_rows(lp, mb["loss_mask"]).float().view(-1, 2).cpu()

    keys = ("tokens", "labels", "loss_mask")
    micro = dpo_microbatches(cfg, {**{k: batch[k] for k in keys}, "index": torch.arange(len(out))})
    with adapters_off(model_chunks):  # a LoRA run's reference: its own base
        forward_only(model_chunks, micro, collect)
    return share_with_pipeline(cp_sum(out))


def precompute(cfg: Config, reference, data: dict, path: Path, key: str) -> tuple[torch.Tensor, bool]:
    """Reference log-probs (N, 2) of every pair of a split, each DP rank computing a contiguous
    share, cached under `key`. reference() gives the reference model (built only when needed)."""
    from megatron.core import parallel_state as ps

    def compute():
        rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        n = len(data["tokens"])
        share = slice(rank * n // size, (rank + 1) * n // size)
        out = torch.zeros(n, 2, dtype=torch.float64)
        out[share] = reference_logps(reference(), {k: v[share] for k, v in data.items()}, cfg).double()
        dist.all_reduce(out, group=ps.get_data_parallel_group())
        return out.float()

    return cached(path, key, compute)


def sft_scale(batch: dict) -> float:
    """Global pairs / global chosen tokens of this step (over the data-parallel ranks)."""
    from megatron.core import parallel_state as ps

    counts = torch.tensor([len(batch["tokens"]), batch["loss_mask"][:, 0].sum().item()], dtype=torch.float64)
    dist.all_reduce(counts, group=ps.get_data_parallel_group())
    return (counts[0] / counts[1].clamp(min=1)).item()


def evaluate(trainee, cfg: Config, val: dict, reference) -> dict:
    mine = dp_share(val)
    if "ref_logps" not in mine:
        mine["ref_logps"] = reference_logps(reference(), mine, cfg)
    r = validation_report(trainee, dpo_microbatches(cfg, mine), partial(dpo_loss, cfg, sft_scale(mine)))
    return metrics_of(r, "val", cfg.algorithm.sft_loss_weight)


def precompute_all(run: Run, data, reference: "Lazy") -> None:
    """algorithm.precompute_reference: every pair's reference log-probs once (cached under the run
    directory), after which no reference model is kept."""
    t0 = time.perf_counter()
    for name, split in (("train", data.train), ("val", data.val)):
        if split is not None:
            key = cache_key(run.cfg, data.paths[name], data.tokenizer)
            split["ref_logps"], _ = precompute(run.cfg, reference, split, run.dir / "reference" / f"{name}.pt", key)
    saved = f"{weight_bytes(reference.value) / 2**20:.1f} MB of weights on each rank" if reference.built else "not built"
    run.log.write(f"reference log-probs {'computed once' if reference.built else 'read from the cache'} in "
                  f"{time.perf_counter() - t0:.1f} s; the reference model ({saved}) is not kept")
    reference.drop()


class Lazy:
    """A value made on first use (the reference model: not built when cached log-probs make it unneeded)."""

    def __init__(self, make):
        self.make, self.value, self.built = make, None, False

    def __call__(self):
        if not self.built:
            self.value, self.built = self.make(), True
        return self.value

    def drop(self):
        self.value, self.built = None, False


def run(cfg: Config, run_dir: Path) -> dict:
    data = preference.prepare(cfg, run_dir, wrong_answer_sampler)
    run = Run(cfg, run_dir, data.tokenizer, data.train, cfg.data.global_batch_size)
    run.log.write(data.note)
    reference = Lazy(lambda: build_reference(cfg, run.trainee, resumed=run.resumed_from is not None))
    if cfg.algorithm.precompute_reference:
        precompute_all(run, data, reference)
    engine = scorer = None
    if data.val_prompts:  # greedy val/accuracy, as SFT and GRPO report it
        engine = RolloutEngine(run.trainee.model, cfg.model, data.tokenizer, cfg.rollout, compute_dtype(cfg))
        scorer = build_scorer(cfg, cfg.rewards.val_fn or "exact_match", data.tokenizer)

    def validate() -> dict:
        out = evaluate(run.trainee, cfg, data.val, reference) if data.val is not None else {}
        return {**out, **(greedy_eval(engine, scorer, data.tokenizer, *data.val_prompts) if engine else {})}

    def step() -> dict:
        with run.phase("train"):
            batch = run.data.next()
            if "ref_logps" not in batch:
                batch["ref_logps"] = reference_logps(reference(), batch, cfg)
            r, grad_norm = train_step(run.trainee, dpo_microbatches(cfg, batch), partial(dpo_loss, cfg, sft_scale(batch)))
        return {**metrics_of(r, "train", cfg.algorithm.sft_loss_weight), "train/grad_norm": grad_norm,
                **schedule_metrics(run.trainee), **run.train_time(2 * cfg.data.global_batch_size * cfg.data.seq_length)}

    with closing_all(scorer):
        return run.loop(step, validate, first=data.truncated(),
                        plot=["train/preference_loss", "val/preference_accuracy", "val/accuracy"])
