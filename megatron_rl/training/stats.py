"""Batch-wide statistics: sums, means and extremes over the data-parallel ranks (which hold different
samples), and the rollout's and routing's agreement with the training forward over all ranks. Each
returns plain numbers for the log, the same on every rank."""

import torch
import torch.distributed as dist


def _dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def global_mean(values: dict[str, float], count: float) -> dict[str, float]:
    """Sums over data-parallel ranks divided by the global count."""
    t = torch.tensor([*values.values(), count], dtype=torch.float64)
    dist.all_reduce(t, group=_dp_group())
    return {k: v / max(t[-1].item(), 1) for k, v in zip(values, t[:-1].tolist())}


def dp_sum(t: torch.Tensor) -> torch.Tensor:
    """t summed over the data-parallel ranks: batch-wide statistics."""
    t = t.clone()
    dist.all_reduce(t, group=_dp_group())
    return t


def on_every_dp_rank(flag: bool) -> bool:
    """Whether `flag` holds on every data-parallel rank."""
    from megatron_rl import platform

    return not platform.any_rank(not flag, _dp_group())


def reward_model_stats(scores: torch.Tensor) -> dict:
    """reward_model/mean, std, min, max of the reward model's scores over the global batch."""
    sums = torch.tensor([scores.sum().item(), (scores.double() ** 2).sum().item(), float(len(scores))],
                        dtype=torch.float64)
    low, high = torch.tensor([scores.min().item()]), torch.tensor([scores.max().item()])
    dist.all_reduce(sums, group=_dp_group())
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=_dp_group())
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=_dp_group())
    mean = sums[0] / sums[2]
    return {"reward_model/mean": mean.item(), "reward_model/std": (sums[1] / sums[2] - mean**2).clamp(min=0).sqrt().item(),
            "reward_model/min": low.item(), "reward_model/max": high.item()}


def episode_metrics(stats: list[dict], count: int) -> dict:
    """Multi-turn episodes' statistics of each sampling round (run_episodes' means over this rank's
    `count` episodes) as means over the rounds and the data-parallel ranks, turns_max as the maximum
    (rollout/truncated_frac is the loop's own, from the rollout's flags)."""
    if not stats:
        return {}
    means = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]
             if k not in ("rollout/turns_max", "rollout/truncated_frac")}
    out = global_mean({k: v * count for k, v in means.items()}, count)
    most = torch.tensor([max(s["rollout/turns_max"] for s in stats)])
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=_dp_group())
    return {**out, "rollout/turns_max": most.item()}


def mismatch_stats(old_logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor) -> dict:
    """How far the rollout's logprobs are from the training forward's, over generated tokens (all ranks)."""
    from megatron.core import parallel_state as ps

    diff = (old_logp - rollout_logp).abs()[loss_mask > 0]
    stats = torch.tensor([diff.max().item() if diff.numel() else 0.0, diff.sum().item(), float(diff.numel())],
                         dtype=torch.float64)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        stats.zero_()  # only the last stage computed logprobs
    top = stats[:1].clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(stats)
    return {"rollout/logprob_mismatch_max": top.item(), "rollout/logprob_mismatch_mean": (stats[1] / stats[2].clamp(min=1)).item()}


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
