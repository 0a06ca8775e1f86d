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

import time
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import losses, platform
from megatron_rl.config import Config, ConfigError
from megatron_rl.data import rl as rl_data
from megatron_rl.data.sft import Batches
from megatron_rl.environments.rewards import build_scorer
from megatron_rl.rollout.engine import Rollout, RolloutEngine
from megatron_rl.rollout.episodes import budget_of, check_observation_format, generate_scored
from megatron_rl.rollout.evaluate import greedy_eval
from megatron_rl.rollout.routing import RoutingTape, pack_routes, routes_queued
from megatron_rl.training.logprobs import entropy, mask_padded_vocab, token_logprobs
from megatron_rl.training.loop import due, finish, save_if_due, schedule_metrics, start_log, train_step
from megatron_rl.training.lora import adapters_off
from megatron_rl.training.reference import build_reference
from megatron_rl.training.setup import build_trainee, compute_dtype, load_initial_state, write_run_assets
from megatron_rl.training.step import cp_sum, first_cp_rank, forward_only, global_mean, make_microbatches, put_tokens


def policy_loss(a, logp: torch.Tensor, old: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss (B, S) and which tokens a clip affected, for the configured variant."""
    adv, mask = batch["advantages"], batch["loss_mask"]
    low, high = a.clip_range()
    match a.policy_loss, a.ratio_level:
        case "ppo", "token":
            return losses.clipped_policy_loss(logp, old, adv, low, high, a.dual_clip)
        case "ppo", "sequence":
            return losses.gspo_policy_loss(logp, old, adv, mask, low, high)
        case "cispo", "token":
            return losses.cispo_policy_loss(logp, old, adv, low, high)
    raise ValueError(f"no policy loss for algorithm.policy_loss={a.policy_loss} with ratio_level={a.ratio_level}")


def grpo_loss(cfg: Config, batch: dict, logits: torch.Tensor, record=None):
    """(loss numerator, denominator, report) for one microbatch; megatron divides the summed
    numerators' gradients by the global sum of denominators. Without batch["old_logp"] the old
    policy is the one being trained (one minibatch, one epoch): its logprobs are this forward's,
    detached, and record(batch, logp) keeps them."""
    a = cfg.algorithm
    logits = mask_padded_vocab(logits, cfg.model.vocab_size)  # (B, S, V/tp)
    mask = batch["loss_mask"]
    entropy_sum = losses.masked_sum(entropy(logits), mask)  # before token_logprobs overwrites the logits
    logp = token_logprobs(logits, batch["labels"])  # (B, S)
    if record is not None:
        record(batch, logp.detach())
    old = batch["old_logp"] if "old_logp" in batch else logp.detach()
    loss, clipped = policy_loss(a, logp, old, batch)
    report = {"clipped": losses.masked_sum(clipped.float(), mask).detach()}
    if a.kl_coef:
        kl = losses.kl_penalty(logp, batch["ref_logp"], a.kl_estimator)
        if not kl_in_reward(a):
            loss = loss + a.kl_coef * kl
        report["kl_sum"] = losses.masked_sum(kl, mask).detach()
    if a.mismatch_correction != "none":
        weights, masked = losses.mismatch_weights(old, batch["rollout_logp"], mask,
                                                  a.mismatch_correction, a.mismatch_threshold)
        loss = loss * weights
        report["mismatch_masked"] = losses.masked_sum(masked.float(), mask)
    num, den = losses.aggregate(loss, mask, a.loss_aggregation, cfg.rollout.max_new_tokens,
                                seq_tokens=cp_sum(mask.sum(dim=1)), count_sequences=first_cp_rank())
    report.update(loss_num=num.detach(), loss_den=den, tokens=mask.sum(), entropy_sum=entropy_sum)
    return num, den.int(), report


def logprobs_of(model_chunks: list, batch: dict, cfg: Config, tape=None, replay: bool = False,
                vocab: int = 0) -> torch.Tensor:
    """Per-token logprobs of the labels (N, S) under `model_chunks`, from the training forward
    (valid on the last pipeline stage; zeros elsewhere). tape: the model's RoutingTape, replaying
    the rollout's routes (or comparing with them). vocab: ids from here on are masked (default:
    model.vocab_size; another model of the same tokenizer may pad its vocabulary differently)."""
    out = torch.zeros_like(batch["loss_mask"])

    def collect(mb, logits):
        put_tokens(out, mb, token_logprobs(mask_padded_vocab(logits, vocab or cfg.model.vocab_size), mb["labels"]))

    keys = ("tokens", "labels", "loss_mask", "index", *(["routes", "fed"] if tape is not None else []))
    micro = make_microbatches(cfg, {k: batch[k] for k in keys}, cfg.data.micro_batch_size)
    with routes_queued(tape, micro, replay):
        forward_only(model_chunks, micro, collect)
    return cp_sum(out)  # each context-parallel rank filled the positions it holds


@dataclass
class Scored:
    """A rollout with its rewards, sample i*n + j answering prompt i (one group per prompt)."""

    prompts: list[list[int]]  # per prompt
    metadata: list[dict]  # per prompt
    rollout: Rollout
    rewards: torch.Tensor  # (N,) what advantages are computed from (shaping included)
    raw: torch.Tensor  # (N,) the reward function's output (accuracy is measured on it)
    components: dict[str, torch.Tensor]  # named reward components, (N,) each
    failures: int = 0
    errors: list = field(default_factory=list)

    def select(self, groups: list[int], n: int) -> "Scored":
        rows = [g * n + j for g in groups for j in range(n)]
        r = self.rollout
        return Scored([self.prompts[g] for g in groups], [self.metadata[g] for g in groups],
                      Rollout(*([getattr(r, f.name)[i] for i in rows] if getattr(r, f.name) else []
                                for f in fields(Rollout))),  # routes: [] without MoE
                      self.rewards[rows], self.raw[rows], {k: v[rows] for k, v in self.components.items()},
                      self.failures, self.errors)

    @staticmethod
    def cat(parts: list["Scored"]) -> "Scored":
        if len(parts) == 1:
            return parts[0]
        r = [p.rollout for p in parts]
        return Scored(sum((p.prompts for p in parts), []), sum((p.metadata for p in parts), []),
                      Rollout(*(sum((getattr(x, f.name) for x in r), []) for f in fields(Rollout))),
                      torch.cat([p.rewards for p in parts]), torch.cat([p.raw for p in parts]),
                      {k: torch.cat([p.components[k] for p in parts]) for k in parts[0].components},
                      sum(p.failures for p in parts), sum((p.errors for p in parts), []))


def shaped(cfg: Config, prompts, metadata, rollout, scores) -> Scored:
    """A rollout with its scores; with rewards.overlong_buffer, DAPO's overlong penalty is added to the reward."""
    raw = torch.tensor(scores.rewards, dtype=torch.float)
    components = {k: torch.tensor(v, dtype=torch.float) for k, v in scores.components.items()}
    rewards = raw
    if cfg.rewards.overlong_buffer:
        penalty = losses.overlong_penalty(torch.tensor(rollout.lengths), cfg.rollout.max_new_tokens,
                                          cfg.rewards.overlong_buffer, cfg.rewards.overlong_penalty)
        rewards = raw + penalty
        if components:
            components["overlong"] = penalty
    return Scored(prompts, metadata, rollout, rewards, raw, components, scores.failures, scores.errors)


def sample(cfg: Config, step: int, engine, runner, tokenizer, next_prompts, seed_offset: int,
           tape=None) -> tuple[Scored, dict]:
    """Roll out and score this rank's prompts. With dynamic sampling (DAPO), groups whose rewards
    are all equal carry no signal: fresh prompts are sampled, up to algorithm.dynamic_sampling_rounds
    extra rounds, until as many informative groups as prompts per step are found (a batch still
    short is filled with uninformative groups, whose advantages are 0)."""
    a, r = cfg.algorithm, cfg.rollout
    parts, rounds, episode_stats = [], 0, []
    while True:
        prompts, metadata = next_prompts()
        seed = r.seed + step * 7919 + seed_offset + 104729 * rounds
        rollout, scores, _, stats = generate_scored(engine, runner, tokenizer, prompts, metadata, r.n, seed, cfg,
                                                    budget_of(cfg), tape=tape)
        parts.append(shaped(cfg, prompts, metadata, rollout, scores))
        if stats:  # multi-turn episodes
            episode_stats.append(stats)
        if not a.dynamic_sampling:
            return parts[0], episode_metrics(episode_stats, len(parts[0].rollout.completions))
        want = len(parts[0].prompts)
        informative = torch.cat([losses.informative_groups(p.raw, r.n) for p in parts])
        # Every data-parallel rank samples the same number of rounds: rollouts (expert parallelism) and
        # reward models are collective over ranks that hold different prompts.
        if everywhere(int(informative.sum()) >= want) or rounds == a.dynamic_sampling_rounds:
            break
        rounds += 1
    scored = Scored.cat(parts)
    order = informative.nonzero().flatten().tolist() + (~informative).nonzero().flatten().tolist()
    stats = {"rollout/dynamic_sampling_rounds": float(rounds), "rollout/dropped_groups": float((~informative).sum()),
             **episode_metrics(episode_stats, len(parts[0].rollout.completions))}
    return scored.select(sorted(order[:want]), r.n), stats


def episode_metrics(stats: list[dict], count: int) -> dict:
    """Multi-turn episodes' statistics of each sampling round (run_episodes' means over this rank's
    `count` episodes) as means over the rounds and the data-parallel ranks, turns_max as the maximum
    (rollout/truncated_frac is the loop's own, from the rollout's flags)."""
    from megatron.core import parallel_state as ps

    if not stats:
        return {}
    means = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]
             if k not in ("rollout/turns_max", "rollout/truncated_frac")}
    out = global_mean({k: v * count for k, v in means.items()}, count)
    most = torch.tensor([max(s["rollout/turns_max"] for s in stats)])
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return {**out, "rollout/turns_max": most.item()}


def everywhere(flag: bool) -> bool:
    """Whether `flag` holds on every data-parallel rank."""
    from megatron.core import parallel_state as ps

    return not platform.any_rank(not flag, ps.get_data_parallel_group())


def reward_model_stats(scores: torch.Tensor) -> dict:
    """reward_model/mean, std, min, max of the reward model's scores over the global batch."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    sums = torch.tensor([scores.sum().item(), (scores.double() ** 2).sum().item(), float(len(scores))],
                        dtype=torch.float64)
    low, high = torch.tensor([scores.min().item()]), torch.tensor([scores.max().item()])
    dist.all_reduce(sums, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    mean = sums[0] / sums[2]
    return {"reward_model/mean": mean.item(), "reward_model/std": (sums[1] / sums[2] - mean**2).clamp(min=0).sqrt().item(),
            "reward_model/min": low.item(), "reward_model/max": high.item()}


def dp_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed over the data-parallel ranks (which hold different samples): batch-wide statistics."""
    from megatron.core import parallel_state as ps

    t = t.clone()
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t


def advantages_of(cfg: Config, scored: Scored, batch: dict | None = None) -> torch.Tensor:
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
            return losses.group_advantages(scored.rewards, n, "loo", "none")
        case "reinforce_pp":
            kl = losses.kl_penalty(batch["rollout_logp"], batch["ref_logp"], a.kl_estimator) if a.kl_coef else None
            return losses.reinforce_pp_advantages(scored.rewards, n, batch["loss_mask"], kl, a.kl_coef, reduce=dp_sum)
    return losses.group_advantages(scored.rewards, n, a.baseline, a.std_normalization, reduce=dp_sum)


def run(cfg: Config, run_dir: Path, critic_class=None) -> dict:
    """The loop; critic_class (PPO's, algorithms/ppo.py) adds a learned critic: it gives the per-token
    advantages, learns before the policy each step, and is saved before it."""
    from megatron.core import parallel_state as ps

    a, r = cfg.algorithm, cfg.rollout
    tokenizer, (train_prompts, train_meta), (val_prompts, val_meta) = rl_data.prompt_splits(cfg, run_dir)
    check_observation_format(cfg, tokenizer)
    trainee = build_trainee(cfg)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    stream = Batches({"index": torch.arange(len(train_prompts))}, a.prompts_per_step, cfg.data.seed, dp_rank, dp)

    def next_prompts():
        index = stream.next()["index"].tolist()
        return [train_prompts[i] for i in index], [train_meta[i] for i in index]

    latest, state = load_initial_state(trainee, cfg, run_dir)
    assets = write_run_assets(cfg, run_dir, tokenizer)
    step = state["step"] if state else 0
    if state:
        stream.load_state_dict(state["extra"]["data"])
    reference = build_reference(cfg, trainee, resumed=latest is not None) if a.kl_coef else None
    critic = critic_class(cfg, run_dir, step if state else None) if critic_class else None
    engine = RolloutEngine(trainee.model, cfg.model, tokenizer, r, compute_dtype(cfg))
    tape = ref_tape = None
    if cfg.model.num_experts:  # MoE: record the rollout's routing; replay it or measure the mismatch
        tape = RoutingTape(trainee.model, cfg.model.moe_topk, cfg.parallel.sp)
        ref_tape = RoutingTape(reference, cfg.model.moe_topk, cfg.parallel.sp) if reference is not None else None
    runner = build_scorer(cfg, cfg.rewards.fn, tokenizer)
    val_fn = cfg.rewards.val_fn or cfg.rewards.fn
    val_scorer = runner if val_fn == cfg.rewards.fn else build_scorer(cfg, val_fn, tokenizer)
    by_model = cfg.rewards.fn == "reward_model"
    log, prof = start_log(cfg, run_dir, step, latest, trainee)
    if step == 0 and val_prompts:  # the starting point, logged as step 0
        log.log(0, greedy_eval(engine, val_scorer, tokenizer, val_prompts, val_meta, cfg))

    metrics = {}
    while step < cfg.train.max_steps:
        prof.step(step)
        times = {}
        t0 = time.perf_counter()
        with prof.range("rollout"):
            scored, sampling_stats = sample(cfg, step, engine, runner, tokenizer, next_prompts, dp_rank, tape)
            rollout, rewards = scored.rollout, scored.raw
            per_token = a.advantage_estimator == "reinforce_pp" or critic  # after the reference's logprobs
            advantages = None if per_token else advantages_of(cfg, scored)
        times["perf/time_rollout_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        with prof.range("logprob"):
            batch = rl_data.pack(rollout.prompts, rollout.completions, cfg.data.seq_length, tokenizer.pad_token_id,
                                 masks=rollout.masks or None, rollout_logp=rollout.logprobs)
            batch["index"] = torch.arange(len(rewards))
            if advantages is not None:
                batch["advantages"] = advantages
            if tape is not None:
                batch.update(pack_routes(rollout.routes, cfg.data.seq_length))
            if not trains_the_old_policy(a):  # else the training forward's logprobs are the old ones
                batch["old_logp"] = logprobs_of(trainee.model, batch, cfg, tape, a.router_replay)
            if reference is not None:
                with adapters_off(reference):
                    batch["ref_logp"] = logprobs_of(reference, batch, cfg, ref_tape, a.router_replay)
            if per_token:
                batch["advantages"] = critic.advantages(scored, batch) if critic else advantages_of(cfg, scored, batch)
        times["perf/time_logprob_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        with prof.range("train"):
            train_metrics = critic.train(batch) if critic else {}
            if not (critic and critic.warming_up(step)):
                train_metrics.update(train_on(trainee, cfg, batch, tape))
        times["perf/time_train_s"] = time.perf_counter() - t0
        mismatch = mismatch_stats(batch) if "old_logp" in batch else {}
        step += 1

        n_local = len(rewards)
        generated = sum(rollout.lengths)
        metrics = {
            **global_mean({"rollout/reward_mean": rewards.sum().item(),
                           **({} if by_model else {"rollout/accuracy": (rewards >= 1).sum().item()}),
                           "rollout/response_len_mean": float(generated),
                           "rollout/truncated_frac": float(sum(rollout.truncated)),
                           "rollout/reward_failure_frac": float(scored.failures)}, n_local),
            **(reward_model_stats(rewards) if by_model else {}), **sampling_stats, **mismatch, **train_metrics, **times, **routing_stats(tape, a.router_replay),
            "perf/rollout_tokens_per_s": generated * dp / times["perf/time_rollout_s"],
            "perf/train_tokens_per_s": batch["loss_mask"].sum().item() * dp * a.epochs / times["perf/time_train_s"],
            **schedule_metrics(trainee),
        }
        if scored.failures:
            log.write(f"warning: step {step}: {scored.failures} samples got reward 0 because scoring failed "
                      f"({'; '.join(scored.errors[:3])})")
        is_last = step == cfg.train.max_steps
        if val_prompts and due(step, cfg.train.eval_every, is_last):
            with prof.range("eval"):
                metrics.update(greedy_eval(engine, val_scorer, tokenizer, val_prompts, val_meta, cfg))
        log.log(step, metrics)
        if save_if_due(cfg, trainee, run_dir, step, is_last, stream.state_dict(), assets, log,
                       before=critic.save if critic else None):
            break
    runner.close()
    val_scorer.close()
    return finish(cfg, trainee, run_dir, assets, log, prof, metrics, plot=["rollout/reward_mean", "val/accuracy"])


def routing_stats(tape, replay: bool) -> dict:
    """moe/routing_replay_frac (token-layer choices of the training-side forwards taken from the
    rollout, over those of the tokens the rollout fed: 1 when replay is complete) or, replay off,
    moe/routing_mismatch_frac (such choices that differ from the rollout's); over all ranks."""
    if tape is None:
        return {}
    c = tape.take_counts()
    t = torch.tensor([c["replayed"], c["routed"], c["mismatched"], c["compared"]], dtype=torch.float64)
    dist.all_reduce(t)
    if replay:
        return {"moe/routing_replay_frac": (t[0] / t[1].clamp(min=1)).item()}
    return {"moe/routing_mismatch_frac": (t[2] / t[3].clamp(min=1)).item()}


def mismatch_stats(batch: dict) -> dict:
    """How far the rollout's logprobs are from the training forward's, over generated tokens."""
    from megatron.core import parallel_state as ps

    mask = batch["loss_mask"] > 0
    diff = (batch["old_logp"] - batch["rollout_logp"]).abs()[mask]
    stats = torch.tensor([diff.max().item() if diff.numel() else 0.0, diff.sum().item(), float(diff.numel())],
                         dtype=torch.float64)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        stats.zero_()  # only the last stage computed logprobs
    top = stats[:1].clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(stats)
    return {"rollout/logprob_mismatch_max": top.item(), "rollout/logprob_mismatch_mean": (stats[1] / stats[2].clamp(min=1)).item()}


def trains_the_old_policy(a) -> bool:
    """Whether the policy that sampled is the one the only optimizer step trains (one minibatch, one
    epoch): then the old logprobs equal the training forward's, and no separate pass computes them."""
    return a.minibatches == 1 and a.epochs == 1


def passes(trainee, cfg: Config, batch: dict, loss_fn, tape=None) -> tuple[dict, list[float]]:
    """algorithm.epochs passes of algorithm.minibatches optimizer steps of `trainee` over this rank's
    batch: (the reports summed over all steps, each step's grad norm)."""
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


def kl_in_reward(a) -> bool:
    """Whether the KL to the reference is part of each token's reward (REINFORCE++, PPO) instead of a
    loss term."""
    return a.advantage_estimator == "reinforce_pp" or a.name == "ppo"


def train_on(trainee, cfg: Config, batch: dict, tape=None) -> dict:
    """algorithm.epochs passes of algorithm.minibatches optimizer steps over this rank's batch.

    Without batch["old_logp"] (see trains_the_old_policy) the loss takes the training forward's own
    logprobs, detached, as the old ones (ratio 1, the full gradient; nothing is clipped), and they
    are written into batch["old_logp"] for the rollout mismatch metrics."""
    a = cfg.algorithm
    record, seen = None, None
    if "old_logp" not in batch:
        seen = torch.zeros_like(batch["loss_mask"], device=platform.device())  # filled without host reads

        def record(mb, logp):
            put_tokens(seen, mb, logp)

    loss_fn = partial(grpo_loss, cfg, record=record)
    keys = ["tokens", "labels", "loss_mask", "advantages", *(["old_logp"] if seen is None else ["index"]),
            *(["ref_logp"] if a.kl_coef else []),
            *(["rollout_logp"] if a.mismatch_correction != "none" else []), *(["routes", "fed"] if tape is not None else [])]
    sums, grad_norms = passes(trainee, cfg, {k: batch[k] for k in keys}, loss_fn, tape)
    if seen is not None:
        batch["old_logp"] = cp_sum(seen).cpu()  # each context-parallel rank filled the positions it holds
    tokens = max(sums.get("tokens", 0.0), 1.0)
    out = {"train/loss": sums.get("loss_num", 0.0) / max(sums.get("loss_den", 0.0), 1.0),
           "train/clip_frac": sums.get("clipped", 0.0) / tokens, "train/entropy": sums.get("entropy_sum", 0.0) / tokens,
           "train/grad_norm": sum(grad_norms) / len(grad_norms), "train/kl": sums.get("kl_sum", 0.0) / tokens}
    if a.mismatch_correction != "none":
        out["train/mismatch_masked_frac"] = sums.get("mismatch_masked", 0.0) / tokens
    return out
