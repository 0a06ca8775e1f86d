"""GRPO and its family: group-relative policy optimization with rollouts from megatron-core's
inference engine on the training model.

Per step: take prompts (this DP rank's share), roll out rollout.n completions each, score them
(optionally resampling prompts whose groups all scored the same: DAPO's dynamic sampling), turn
rewards into group advantages (GRPO or GDPO), recompute the sampled tokens' logprobs with the
training forward (the old policy; also the reference's when algorithm.kl_coef > 0), then
algorithm.epochs x algorithm.minibatches optimizer steps on the policy loss: PPO's clipped
surrogate per token (clip-higher, dual clip) or per sequence (GSPO), or CISPO; optionally weighted
by p_train / p_rollout (mismatch correction). Its aggregation (token, sequence, constant) is a
numerator and a denominator summed over the global batch, which megatron divides.

PPO with a critic is this loop with algorithms/ppo.py's Critic. With a multi-turn environment each sample
is an episode (rollout/episodes.py): its observations are part of the sequence, out of the loss.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rl import losses
from megatron_rl.config import Config, ConfigError
from megatron_rl.data import rl as rl_data
from megatron_rl.environments.rewards import build_scorer
from megatron_rl.rollout.disaggregated import Disaggregated, serve
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.episodes import check_observation_format
from megatron_rl.rollout.evaluate import greedy_eval
from megatron_rl.rollout.groups import Scored, sample_groups
from megatron_rl.training.lora import adapters_off
from megatron_rl.training.policy import RLBatch, logprobs_of, one_update_per_batch, train_policy
from megatron_rl.training.reference import build_reference
from megatron_rl.training.routing import RoutingTape
from megatron_rl.training.run import Run, closing_all
from megatron_rl.training.setup import compute_dtype
from megatron_rl.training.stats import dp_sum, global_mean, mismatch_stats, reward_model_stats, routing_stats
from megatron_rl.training.step import schedule_metrics


@dataclass
class Models:
    """What the loop needs besides the trainee: the engine that samples on it, the scorers, the
    reference policy and the critic (when used), and MoE routing tapes."""

    engine: RolloutEngine | None  # None (and no scorers) on the training ranks of a disaggregated job
    scorer: object  # training rewards (rewards.fn)
    val_scorer: object  # validation (rewards.val_fn, default the same)
    reference: list | None = None
    critic: object = None
    tape: RoutingTape | None = None  # the trainee's: the rollout's routes, replayed or compared
    ref_tape: RoutingTape | None = None


def build_models(cfg: Config, run: Run, tokenizer, critic_class=None, remote: Disaggregated | None = None) -> Models:
    """remote: the generation ranks of a disaggregated job, which then roll out and score instead."""
    r, m = cfg.rollout, cfg.model
    reference = build_reference(cfg, run.trainee, resumed=run.resumed_from is not None) if cfg.algorithm.kl_coef else None
    critic = critic_class(cfg, run.dir, run.step if run.resumed_from is not None else None) if critic_class else None
    engine = RolloutEngine(run.trainee.model, m, tokenizer, r, compute_dtype(cfg)) if remote is None else None
    tape = ref_tape = None
    if m.num_experts:  # MoE: record the rollout's routing; replay it or measure the mismatch
        tape = RoutingTape(run.trainee.model, m.moe_topk, cfg.parallel.sp)
        ref_tape = RoutingTape(reference, m.moe_topk, cfg.parallel.sp) if reference is not None else None
    if remote is not None:
        return Models(None, None, None, reference, critic, tape, ref_tape)
    scorer = build_scorer(cfg, cfg.rewards.fn, tokenizer)
    val_fn = cfg.rewards.val_fn or cfg.rewards.fn
    val_scorer = scorer if val_fn == cfg.rewards.fn else build_scorer(cfg, val_fn, tokenizer)
    return Models(engine, scorer, val_scorer, reference, critic, tape, ref_tape)


def rollout_metrics(scored: Scored, by_reward_model: bool) -> dict:
    """rollout/* means over the global batch (accuracy: the share of samples scoring >= 1, which a reward
    model's scores do not mean; reward_model/* describe those instead)."""
    scores, rollout = scored.scores, scored.rollout
    sums = {"rollout/reward_mean": scores.sum().item(),
            **({} if by_reward_model else {"rollout/accuracy": (scores >= 1).sum().item()}),
            "rollout/response_len_mean": float(sum(rollout.lengths)),
            "rollout/truncated_frac": float(sum(rollout.truncated)), "rollout/reward_failure_frac": float(scored.failures)}
    return {**global_mean(sums, len(scores)), **(reward_model_stats(scores) if by_reward_model else {}),
            **(filter_gap(rollout) if rollout.thresholds else {})}


def filter_gap(rollout) -> dict:
    """rollout/filtered_logprob_gap: the mean over sampled tokens (all ranks) of log p under the top-p /
    top-k sampler's kept set, renormalized, minus log p under the full distribution: minus the log of the
    probability mass the filter kept (0 when it kept everything)."""
    masks = rollout.masks or [[1.0] * len(c) for c in rollout.completions]
    gap = sum((f - u) * m for fs, us, ms in zip(rollout.logprobs, rollout.full_logprobs, masks)
              for f, u, m in zip(fs, us, ms))
    return global_mean({"rollout/filtered_logprob_gap": gap}, sum(sum(m) for m in masks))


def old_and_reference_logprobs(cfg: Config, trainee, models: Models, batch: RLBatch) -> None:
    """batch.old_logp (unless the one optimizer step's own forward gives them) and, with a KL penalty,
    batch.ref_logp, each replaying the rollout's MoE routes when algorithm.router_replay."""
    replay = cfg.algorithm.router_replay
    if not one_update_per_batch(cfg.algorithm):
        batch.old_logp = logprobs_of(trainee.model, batch.tensors(), cfg, models.tape, replay, filtered=True)
    if models.reference is not None:
        with adapters_off(models.reference):
            batch.ref_logp = logprobs_of(models.reference, batch.tensors(), cfg, models.ref_tape, replay)


def advantages_of(cfg: Config, scored: Scored, batch: RLBatch | None = None) -> torch.Tensor:
    """Per-sample advantages (N,), or per token (N, S) for reinforce_pp, which needs the packed batch
    (its loss mask, and with a KL penalty the reference's and the rollout's logprobs)."""
    a, n = cfg.algorithm, cfg.rollout.n
    match a.advantage_estimator:
        case "gdpo":
            if not scored.components:
                raise ConfigError(f"algorithm.advantage_estimator=gdpo needs named reward components, but rewards.fn="
                                  f"{cfg.rewards.fn!r} returns a single number; use a function returning a dict.")
            names = sorted(scored.components)
            weights = torch.tensor([cfg.rewards.weights.get(k, 1.0) for k in names])
            return losses.gdpo_advantages(torch.stack([scored.components[k] for k in names], dim=1), weights, n,
                                          reduce=dp_sum)
        case "rloo":
            return losses.group_advantages(scored.shaped, n, "loo", "none")
        case "reinforce_pp":
            kl = losses.kl_penalty(batch.unfiltered_rollout_logp, batch.ref_logp, a.kl_estimator) if a.kl_coef else None
            return losses.reinforce_pp_advantages(scored.shaped, n, batch.loss_mask, kl, a.kl_coef, reduce=dp_sum)
    return losses.group_advantages(scored.shaped, n, a.baseline, a.std_normalization, reduce=dp_sum)


def run(cfg: Config, run_dir: Path, critic_class=None) -> dict:
    """The loop; critic_class (PPO's, algorithms/ppo.py) adds a learned critic: it gives the per-token
    advantages, learns before the policy each step, and is saved before it."""
    from megatron.core import parallel_state as ps

    from megatron_rl.platform import bridge

    if bridge.side() is not None and bridge.side().name == "rollout":
        return serve(cfg)  # a generation rank of a disaggregated job
    a = cfg.algorithm
    tokenizer, (train_prompts, train_meta), (val_prompts, val_meta) = rl_data.prompt_splits(cfg, run_dir)
    check_observation_format(cfg, tokenizer)
    run = Run(cfg, run_dir, tokenizer, {"index": torch.arange(len(train_prompts))}, a.prompts_per_step)
    remote = Disaggregated(cfg, run, tokenizer, (train_prompts, train_meta), (val_prompts, val_meta)) \
        if bridge.side() is not None else None
    models = build_models(cfg, run, tokenizer, critic_class, remote)
    critic, dp_rank, dp = models.critic, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def next_prompts():
        index = run.data.next()["index"].tolist()
        return [train_prompts[i] for i in index], [train_meta[i] for i in index]

    def step() -> dict:
        with run.phase("rollout"):
            scored, sampling = remote.sample(run.step, models.tape) if remote else sample_groups(
                cfg, run.step, models.engine, models.scorer, tokenizer, next_prompts, dp_rank, models.tape)
            per_token = a.advantage_estimator == "reinforce_pp" or critic  # after the reference's logprobs
            advantages = None if per_token else advantages_of(cfg, scored)
        with run.phase("logprob"):
            batch = RLBatch.of(scored.rollout, cfg.data.seq_length, tokenizer.pad_token_id, models.tape is not None)
            batch.advantages = advantages
            old_and_reference_logprobs(cfg, run.trainee, models, batch)
            if per_token:
                batch.advantages = critic.advantages(scored, batch) if critic else advantages_of(cfg, scored, batch)
        with run.phase("train"):
            train = critic.train(batch) if critic else {}
            if not (critic and critic.warming_up(run.step)):
                policy, batch.old_logp = train_policy(run.trainee, cfg, batch, models.tape)
                train.update(policy)
        if scored.failures:
            run.log.write(f"warning: step {run.step + 1}: {scored.failures} samples got reward 0 because scoring failed "
                          f"({'; '.join(scored.errors[:3])})")
        times = run.phase_times()
        return {**rollout_metrics(scored, cfg.rewards.fn == "reward_model"), **sampling,
                **(mismatch_stats(batch.old_logp, batch.rollout_logp, batch.loss_mask) if batch.old_logp is not None else {}),
                **train, **times, **routing_stats(models.tape, a.router_replay),
                "perf/rollout_tokens_per_s": sum(scored.rollout.lengths) * dp / times["perf/time_rollout_s"],
                "perf/train_tokens_per_s": batch.loss_mask.sum().item() * dp * a.epochs / times["perf/time_train_s"],
                **schedule_metrics(run.trainee)}

    def validate() -> dict:
        if remote:
            return remote.validate()
        return greedy_eval(models.engine, models.val_scorer, tokenizer, val_prompts, val_meta, cfg)

    with closing_all(models.scorer, models.val_scorer):
        final = run.loop(step, validate if val_prompts else None, before_save=critic.save if critic else None,
                         plot=["rollout/reward_mean", "val/accuracy"])
    if remote:
        remote.finish()
    return final
