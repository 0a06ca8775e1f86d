"""Held-out accuracy the way it is reported: greedy decoding of the validation prompts with the
rollout engine, scored by a reward (exact match on the arithmetic task)."""

import torch

from megatron_rl.training.step import global_mean


def decode(tokenizer, ids: list[list[int]]) -> list[str]:
    return [tokenizer.decode(x, skip_special_tokens=True) for x in ids]


def greedy_eval(engine, scorer, tokenizer, prompts: list[list[int]], metadata: list[dict]) -> dict:
    """This DP rank's share of the prompts, decoded greedily and scored: val/accuracy (share with
    reward >= 1) and val/reward_mean over all ranks; where rows name a 'teacher' (several operations of
    the arithmetic task, multi-teacher distillation), also val/accuracy_<teacher> per name."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = prompts[rank::size]
    rollout = engine.generate(mine, n=1, greedy=True)
    rewards = torch.tensor(scorer.score(decode(tokenizer, mine), decode(tokenizer, rollout.completions),
                                        metadata[rank::size], ids=(mine, rollout.completions)).rewards)
    out = global_mean({"val/reward_mean": rewards.sum().item(), "val/accuracy": (rewards >= 1).sum().item()},
                      len(mine))
    names = sorted({m["teacher"] for m in metadata if "teacher" in m})  # the same on every rank
    if names:
        import torch.distributed as dist

        mine_names = [m.get("teacher") for m in metadata[rank::size]]
        t = torch.tensor([[float(sum(r >= 1 for r, n in zip(rewards.tolist(), mine_names) if n == name)),
                           float(mine_names.count(name))] for name in names], dtype=torch.float64)
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        out.update({f"val/accuracy_{name}": (t[i, 0] / t[i, 1].clamp(min=1)).item() for i, name in enumerate(names)})
    return out
