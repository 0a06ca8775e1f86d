"""Held-out accuracy the way it is reported: greedy decoding of the validation prompts with the
rollout engine, scored by a reward (exact match on the arithmetic task)."""

import torch

from megatron_rl.training.step import global_mean


def decode(tokenizer, ids: list[list[int]]) -> list[str]:
    return [tokenizer.decode(x, skip_special_tokens=True) for x in ids]


def greedy_eval(engine, scorer, tokenizer, prompts: list[list[int]], metadata: list[dict]) -> dict:
    """This DP rank's share of the prompts, decoded greedily and scored: val/accuracy (share with
    reward >= 1) and val/reward_mean over all ranks."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = prompts[rank::size]
    rollout = engine.generate(mine, n=1, greedy=True)
    rewards = torch.tensor(scorer.score(decode(tokenizer, mine), decode(tokenizer, rollout.completions),
                                        metadata[rank::size], ids=(mine, rollout.completions)).rewards)
    return global_mean({"val/reward_mean": rewards.sum().item(), "val/accuracy": (rewards >= 1).sum().item()},
                       len(mine))
