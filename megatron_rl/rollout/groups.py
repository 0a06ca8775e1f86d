"""Groups of samples for the GRPO family: rollout.n samples of each prompt, scored, with DAPO's
overlong penalty and dynamic sampling."""

from dataclasses import dataclass, field, fields

import torch

from megatron_rl import losses
from megatron_rl.config import Config
from megatron_rl.rollout.engine import Rollout, sampling_seed
from megatron_rl.rollout.episodes import budget_of, generate_scored
from megatron_rl.training.stats import episode_metrics, on_every_dp_rank


@dataclass
class Scored:
    """A rollout with its rewards, sample i*n + j answering prompt i (one group per prompt)."""

    prompts: list[list[int]]  # per prompt
    metadata: list[dict]  # per prompt
    rollout: Rollout
    shaped: torch.Tensor  # (N,) the rewards advantages are computed from: `scores` plus DAPO's overlong penalty
    scores: torch.Tensor  # (N,) the reward function's output (accuracy is measured on it)
    components: dict[str, torch.Tensor]  # named reward components, (N,) each
    failures: int = 0
    errors: list = field(default_factory=list)

    def select(self, groups: list[int], n: int) -> "Scored":
        rows = [g * n + j for g in groups for j in range(n)]
        r = self.rollout
        return Scored([self.prompts[g] for g in groups], [self.metadata[g] for g in groups],
                      Rollout(*([getattr(r, f.name)[i] for i in rows] if getattr(r, f.name) else []
                                for f in fields(Rollout))),  # routes: [] without MoE
                      self.shaped[rows], self.scores[rows], {k: v[rows] for k, v in self.components.items()},
                      self.failures, self.errors)

    @staticmethod
    def cat(parts: list["Scored"]) -> "Scored":
        if len(parts) == 1:
            return parts[0]
        r = [p.rollout for p in parts]
        return Scored(sum((p.prompts for p in parts), []), sum((p.metadata for p in parts), []),
                      Rollout(*(sum((getattr(x, f.name) for x in r), []) for f in fields(Rollout))),
                      torch.cat([p.shaped for p in parts]), torch.cat([p.scores for p in parts]),
                      {k: torch.cat([p.components[k] for p in parts]) for k in parts[0].components},
                      sum(p.failures for p in parts), sum((p.errors for p in parts), []))


def with_overlong_penalty(cfg: Config, prompts, metadata, rollout, scores) -> Scored:
    """A rollout with its scores; with rewards.overlong_buffer, DAPO's overlong penalty is added to the
    rewards that advantages are computed from (and is a component of its own)."""
    raw = torch.tensor(scores.rewards, dtype=torch.float)
    components = {k: torch.tensor(v, dtype=torch.float) for k, v in scores.components.items()}
    shaped = raw
    if cfg.rewards.overlong_buffer:
        penalty = losses.overlong_penalty(torch.tensor(rollout.lengths), cfg.rollout.max_new_tokens,
                                          cfg.rewards.overlong_buffer, cfg.rewards.overlong_penalty)
        shaped = raw + penalty
        if components:
            components["overlong"] = penalty
    return Scored(prompts, metadata, rollout, shaped, raw, components, scores.failures, scores.errors)


def sample_groups(cfg: Config, step: int, engine, scorer, tokenizer, next_prompts, rank: int,
                  tape=None) -> tuple[Scored, dict]:
    """Roll out and score this rank's prompts (next_prompts() gives them: token ids and metadata). With
    dynamic sampling (DAPO), groups whose rewards are all equal carry no signal: fresh prompts are
    sampled, up to algorithm.dynamic_sampling_rounds extra rounds, until as many informative groups as
    prompts per step are found (a batch still short is filled with uninformative groups, whose
    advantages are 0). Returns the groups and the rollout/* statistics of the sampling."""
    a, r = cfg.algorithm, cfg.rollout
    parts, rounds, episode_stats = [], 0, []
    while True:
        prompts, metadata = next_prompts()
        seed = sampling_seed(r.seed, step, rank, rounds)
        rollout, scores, _, stats = generate_scored(engine, scorer, tokenizer, prompts, metadata, r.n, seed, cfg,
                                                    budget_of(cfg), tape=tape)
        parts.append(with_overlong_penalty(cfg, prompts, metadata, rollout, scores))
        if stats:  # multi-turn episodes
            episode_stats.append(stats)
        if not a.dynamic_sampling:
            return parts[0], episode_metrics(episode_stats, len(parts[0].rollout.completions))
        want = len(parts[0].prompts)
        informative = torch.cat([losses.informative_groups(p.scores, r.n) for p in parts])
        # Every data-parallel rank samples the same number of rounds: rollouts (expert parallelism) and
        # reward models are collective over ranks that hold different prompts.
        if on_every_dp_rank(int(informative.sum()) >= want) or rounds == a.dynamic_sampling_rounds:
            break
        rounds += 1
    scored = Scored.cat(parts)
    order = informative.nonzero().flatten().tolist() + (~informative).nonzero().flatten().tolist()
    stats = {"rollout/dynamic_sampling_rounds": float(rounds), "rollout/dropped_groups": float((~informative).sum()),
             **episode_metrics(episode_stats, len(parts[0].rollout.completions))}
    return scored.select(sorted(order[:want]), r.n), stats
