"""The policy's side of every RL loop (GRPO and its family, PPO, multi-teacher distillation): the batch
of rollouts as the trainer holds it, the logprobs of its sampled tokens under a model, the policy-
gradient loss, and the optimizer passes over the batch.

A batch makes algorithm.epochs x algorithm.minibatches optimizer steps. When that is one step, the
policy that sampled is the one the step trains: the old policy's logprobs are the training forward's
own, detached (ratio 1), and no separate forward computes them (`one_update_per_batch`).
"""

from dataclasses import dataclass, fields
from functools import partial

import torch

from megatron_rl import losses, platform
from megatron_rl.config import Config
from megatron_rl.data import rl as rl_data
from megatron_rl.training.logprobs import entropy, kept_size, mask_padded_vocab, token_logprobs
from megatron_rl.training.routing import pack_routes, routes_queued
from megatron_rl.training.step import cp_sum, first_cp_rank, forward_only, make_microbatches, put_tokens, train_step


@dataclass
class RLBatch:
    """This rank's samples packed for the trainer: (N, S) tensors over the sequence positions, each
    per-token value at its label's position, unless noted."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor  # 1 at the generated tokens the loss counts (not prompts, observations, padding)
    rollout_logp: torch.Tensor  # the sampler's logprobs of the sampled tokens
    index: torch.Tensor  # (N,) each row's number, to put per-token results back in place
    # top-p / top-k: the sampler's kept set (every logit >= threshold; -inf: all), its size, and the
    # full distribution's logprobs (rollout_logp are then the kept set's)
    threshold: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    rollout_full_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # (N,) per sample, or (N, S) per token
    old_logp: torch.Tensor | None = None  # the old policy's logprobs (None: the training forward's own)
    ref_logp: torch.Tensor | None = None  # the reference policy's (a KL penalty)
    routes: torch.Tensor | None = None  # MoE: the rollout's experts per token and layer (training/routing.py)
    fed: torch.Tensor | None = None
    old_values: torch.Tensor | None = None  # PPO: the critic's values before its update
    returns: torch.Tensor | None = None  # PPO: the critic's targets

    @classmethod
    def of(cls, rollout, seq_length: int, pad_id: int, routes: bool = False, replay_filter: bool = True) -> "RLBatch":
        """A rollout's samples (rollout/engine.Rollout) packed; with `routes`, their MoE routes too. A top-p /
        top-k rollout's kept sets come with it for training to replay; without `replay_filter`, its logprobs
        are the full distribution's instead (distillation's)."""
        filtered = {}
        if rollout.thresholds and replay_filter:
            filtered = dict(threshold=rollout.thresholds, kept=rollout.kept, rollout_full_logp=rollout.full_logprobs)
        packed = rl_data.pack(rollout.prompts, rollout.completions, seq_length, pad_id, masks=rollout.masks or None,
                              fill={"threshold": float("-inf")}, **filtered,
                              rollout_logp=rollout.full_logprobs if rollout.thresholds and not replay_filter
                              else rollout.logprobs)
        extra = pack_routes(rollout.routes, seq_length) if routes else {}
        return cls(**packed, index=torch.arange(len(rollout.completions)), **extra)

    @property
    def unfiltered_rollout_logp(self) -> torch.Tensor:
        """The sampler's logprobs under the full distribution (a KL to the reference takes these)."""
        return self.rollout_logp if self.rollout_full_logp is None else self.rollout_full_logp

    def tensors(self, *names: str) -> dict[str, torch.Tensor]:
        """The fields named (default: all) that are set, by name: what microbatches are cut from."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if (not names or f.name in names) and getattr(self, f.name) is not None}


def one_update_per_batch(a) -> bool:
    """Whether each batch makes a single optimizer step (one minibatch, one epoch): then the policy that
    sampled is the one trained, and the old logprobs are the training forward's own."""
    return a.minibatches == 1 and a.epochs == 1


def kl_in_reward(a) -> bool:
    """Whether the KL to the reference is part of each token's reward (REINFORCE++, PPO) instead of a
    loss term."""
    return a.advantage_estimator == "reinforce_pp" or a.name == "ppo"


def logprobs_of(model_chunks: list, batch: dict, cfg: Config, tape=None, replay: bool = False,
                vocab: int = 0, filtered: bool = False) -> torch.Tensor:
    """Per-token logprobs of the labels (N, S) under `model_chunks`, from the training forward
    (valid on the last pipeline stage; zeros elsewhere). batch: tokens, labels, loss_mask, index (and
    routes, fed with a tape). tape: the model's RoutingTape, replaying the rollout's routes (or comparing
    with them). vocab: ids from here on are masked (default: model.vocab_size; another model of the same
    tokenizer may pad its vocabulary differently). filtered: over the sampler's kept sets where the batch
    has them (batch["threshold"]: the policy's own), else the full distribution (the reference's)."""
    out = torch.zeros_like(batch["loss_mask"])
    filtered = filtered and "threshold" in batch

    def collect(mb, logits):
        logits = mask_padded_vocab(logits, vocab or cfg.model.vocab_size)
        put_tokens(out, mb, token_logprobs(logits, mb["labels"], mb["threshold"] if filtered else None))

    keys = ("tokens", "labels", "loss_mask", "index", *(["routes", "fed"] if tape is not None else []),
            *(["threshold"] if filtered else []))
    micro = make_microbatches(cfg, {k: batch[k] for k in keys}, cfg.data.micro_batch_size)
    with routes_queued(tape, micro, replay):
        forward_only(model_chunks, micro, collect)
    return cp_sum(out)  # each context-parallel rank filled the positions it holds


def clipped_loss(a, logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss (B, S) and which tokens a clip affected, for the configured variant: PPO's
    clipped surrogate per token (clip-higher, dual clip) or per sequence (GSPO), or CISPO."""
    low, high = a.clip_range()
    match a.policy_loss, a.ratio_level:
        case "ppo", "token":
            return losses.clipped_policy_loss(logp, old, advantages, low, high, a.dual_clip)
        case "ppo", "sequence":
            return losses.gspo_policy_loss(logp, old, advantages, mask, low, high)
        case "cispo", "token":
            return losses.cispo_policy_loss(logp, old, advantages, low, high)
    raise ValueError(f"no policy loss for algorithm.policy_loss={a.policy_loss} with ratio_level={a.ratio_level}")


def policy_gradient_loss(cfg: Config, batch: dict, logits: torch.Tensor, keep_logp=None):
    """(loss numerator, denominator, report) for one microbatch; megatron divides the summed
    numerators' gradients by the global sum of denominators. With keep_logp the old policy is the one
    being trained: its logprobs are this forward's, detached, handed to keep_logp(batch, logp); without
    it they are batch["old_logp"]."""
    a = cfg.algorithm
    logits = mask_padded_vocab(logits, cfg.model.vocab_size)  # (B, S, V/tp)
    mask, threshold = batch["loss_mask"], batch.get("threshold")
    # the entropy and the KL to the reference are the full distribution's; the policy's logprobs are over
    # the sampler's kept sets where it filtered (rollout.top_p, top_k)
    entropy_sum = losses.masked_sum(entropy(logits), mask)  # before token_logprobs overwrites the logits
    report = {}
    if threshold is not None:
        report["filter_differs"] = losses.masked_sum((kept_size(logits, threshold) != batch["kept"]).float(),
                                                     mask * (threshold > float("-inf")))
    logp = token_logprobs(logits, batch["labels"], threshold)  # (B, S)
    full_logp = logp if threshold is None or not a.kl_coef else token_logprobs(logits, batch["labels"])
    if keep_logp is not None:
        keep_logp(batch, logp.detach())
    proximal = batch["old_logp"] if keep_logp is None else logp.detach()
    # off_policy=rollout_ratio: the behaviour policy (the rollout's) is the old one the ratio is taken against
    old = batch["rollout_logp"] if a.stale() and a.off_policy == "rollout_ratio" else proximal
    loss, clipped = clipped_loss(a, logp, old, batch["advantages"], mask)
    report["clipped"] = losses.masked_sum(clipped.float(), mask).detach()
    if a.kl_coef:
        kl = losses.kl_penalty(full_logp, batch["ref_logp"], a.kl_estimator)
        if not kl_in_reward(a):
            loss = loss + a.kl_coef * kl
        report["kl_sum"] = losses.masked_sum(kl, mask).detach()
    if a.correction() != "none":  # off_policy=decoupled: AReaL's behaviour weight p_proximal / p_rollout
        weights, masked = losses.mismatch_weights(proximal, batch["rollout_logp"], mask, a.correction(),
                                                  a.mismatch_threshold)
        loss = loss * weights
        report["mismatch_masked"] = losses.masked_sum(masked.float(), mask)
    num, den = losses.aggregate(loss, mask, a.loss_aggregation, cfg.rollout.max_new_tokens,
                                seq_tokens=cp_sum(mask.sum(dim=1)), count_sequences=first_cp_rank())
    report.update(loss_num=num.detach(), loss_den=den, tokens=mask.sum(), entropy_sum=entropy_sum)
    return num, den.int(), report


def optimizer_passes(trainee, cfg: Config, batch: dict, loss_fn, tape=None) -> tuple[dict, list[float]]:
    """algorithm.epochs passes of algorithm.minibatches optimizer steps of `trainee` over this rank's
    batch (a dict of tensors): (the reports summed over all steps, each step's grad norm)."""
    a = cfg.algorithm
    n = len(batch["tokens"])
    per_minibatch = n // a.minibatches
    sums, grad_norms = {}, []
    order = torch.arange(n)
    for epoch in range(a.epochs):
        if epoch:  # reshuffle samples between epochs, the same way on every rank of a DP replica
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        for m in range(a.minibatches):
            idx = order[m * per_minibatch : (m + 1) * per_minibatch]
            micro = make_microbatches(cfg, {k: v[idx] for k, v in batch.items()}, cfg.data.micro_batch_size)
            with routes_queued(tape, micro, a.router_replay):
                report, grad_norm = train_step(trainee, micro, loss_fn)
            grad_norms.append(grad_norm)
            for k, v in report.items():
                sums[k] = sums.get(k, 0.0) + v
    return sums, grad_norms


def train_policy(trainee, cfg: Config, batch: RLBatch, tape=None) -> tuple[dict, torch.Tensor]:
    """The policy's optimizer passes over this rank's batch: (train/* metrics, the old policy's logprobs).
    Without batch.old_logp (one_update_per_batch) the loss takes the training forward's own logprobs,
    detached, as the old ones (ratio 1, the full gradient; nothing is clipped), and returns them."""
    a = cfg.algorithm
    keep_logp, seen = None, None
    if batch.old_logp is None:
        seen = torch.zeros_like(batch.loss_mask, device=platform.device())  # filled without host reads

        def keep_logp(mb, logp):
            put_tokens(seen, mb, logp)

    loss_fn = partial(policy_gradient_loss, cfg, keep_logp=keep_logp)
    sums, grad_norms = optimizer_passes(trainee, cfg, batch.tensors(), loss_fn, tape)
    old_logp = batch.old_logp if seen is None else cp_sum(seen).cpu()  # each CP rank filled its positions
    tokens = max(sums.get("tokens", 0.0), 1.0)
    out = {"train/loss": sums.get("loss_num", 0.0) / max(sums.get("loss_den", 0.0), 1.0),
           "train/clip_frac": sums.get("clipped", 0.0) / tokens, "train/entropy": sums.get("entropy_sum", 0.0) / tokens,
           "train/grad_norm": sum(grad_norms) / len(grad_norms), "train/kl": sums.get("kl_sum", 0.0) / tokens}
    if a.correction() != "none":
        out["train/mismatch_masked_frac"] = sums.get("mismatch_masked", 0.0) / tokens
    if batch.threshold is not None:  # tokens whose kept set, replayed in training, is not the sampler's size
        out["train/filter_size_mismatch_frac"] = sums.get("filter_differs", 0.0) / tokens
    return out, old_logp
