"""Held-out accuracy the way it is reported: greedy decoding of the validation prompts with the
rollout engine, scored by a reward (exact match on the arithmetic task)."""

import torch

from megatron_rl.training.stats import global_mean


def greedy_eval(engine, scorer, tokenizer, prompts: list[list[int]], metadata: list[dict], cfg=None) -> dict:
    """This DP rank's share of the prompts, decoded greedily and scored: val/accuracy (share with
    reward >= 1) and val/reward_mean over all ranks; where rows name a 'teacher' (several operations of
    the arithmetic task, multi-teacher distillation), also val/accuracy_<teacher> per name. With a
    multi-turn environment (cfg's rollout.max_turns and sequence budget), greedy episodes."""
    from megatron.core import parallel_state as ps

    from megatron_rl.rollout.episodes import budget_of, generate_scored

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = prompts[rank::size]
    _, scores, _, _ = generate_scored(engine, scorer, tokenizer, mine, metadata[rank::size], 1, 0, cfg,
                                      budget_of(cfg) if cfg is not None else 0, greedy=True)
    rewards = torch.tensor(scores.rewards)
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


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with c correct among n samples: the chance that k of them,
    drawn without replacement, hold at least one correct, 1 - C(n-c, k) / C(n, k), in its stable
    product form 1 - prod_{i=n-c+1}^{n} (1 - k/i) (Chen et al., 2021)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (got n={n}, c={c}, k={k}).")
    if n - c < k:
        return 1.0
    out = 1.0
    for i in range(n - c + 1, n + 1):
        out *= 1.0 - k / i
    return 1.0 - out


def maj_at_k(answers: list, correct: list[bool], k: int) -> float:
    """maj@k of one prompt's n samples: the mean, over all C(n, k) subsets of k samples, of whether
    the subset's majority answer is correct. A tie between t answers scores (correct among them) / t,
    the expected value of breaking it at random. Samples with the same answer form one class (an
    answer is any hashable, None for 'nothing extracted', a class never correct); a class is correct
    if its first sample is. Computed exactly without enumerating subsets: for each correct class c
    and each size m of it in the subset, count the ways the other classes take k - m samples with
    none above m, by how many tie at m."""
    from math import comb

    n = len(answers)
    if not 0 < k <= n or len(correct) != n:
        raise ValueError(f"maj@k needs 0 < k <= n and one correctness per answer (got n={n}, k={k}).")
    counts, good = {}, {}
    for a, ok in zip(answers, correct):
        counts[a] = counts.get(a, 0) + 1
        good.setdefault(a, bool(ok) and a is not None)
    classes = list(counts)
    total = 0.0
    for c in (x for x in classes if good[x]):
        others = [counts[x] for x in classes if x != c]
        for m in range(1, min(counts[c], k) + 1):
            # ways[s][t]: subsets of the other classes with s samples, t of the classes at exactly m
            ways = [[0] * (len(others) + 1) for _ in range(k - m + 1)]
            ways[0][0] = 1
            for size in others:
                nxt = [[0] * (len(others) + 1) for _ in range(k - m + 1)]
                for s in range(k - m + 1):
                    for t in range(len(others) + 1):
                        if ways[s][t]:
                            for x in range(min(size, m, k - m - s) + 1):
                                nxt[s + x][t + (x == m)] += ways[s][t] * comb(size, x)
                ways = nxt
            total += comb(counts[c], m) * sum(w / (t + 1) for t, w in enumerate(ways[k - m]))
    return total / comb(n, k)
