"""Advantages and policy losses: pure functions of tensors (no model, no config, no distributed state).

Shapes: (N,) per sample, (N, T) per token with a 0/1 `mask` of the tokens that count.
"""

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, baseline: str = "mean", std: str = "group",
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each sample's reward minus its group's baseline, optionally scaled.

    rewards: (N,), groups are consecutive runs of `group_size` samples (one prompt each).
    baseline: 'mean' (group mean) or 'loo' (mean of the other samples of the group).
    std: 'group' (divide by the group's std), 'batch' (by the whole batch's std) or 'none'.
    """
    r = rewards.reshape(-1, group_size).double()  # (groups, G)
    match baseline:
        case "mean":
            adv = r - r.mean(dim=1, keepdim=True)
        case "loo":
            if group_size < 2:
                raise ValueError("the leave-one-out baseline needs at least 2 samples per group")
            adv = r - (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
        case _:
            raise ValueError(f"unknown advantage baseline {baseline!r}; use 'mean' or 'loo'")
    match std:
        case "group":
            adv = adv / (r.std(dim=1, keepdim=True) + eps)
        case "batch":
            adv = adv / (r.std() + eps)
        case "none":
            pass
        case _:
            raise ValueError(f"unknown std normalization {std!r}; use 'group', 'batch' or 'none'")
    return adv.reshape(-1).to(rewards.dtype)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3)."""
    log_ratio = ref_logp - logp  # log(p_ref / p)
    match estimator:
        case "k1":
            return -log_ratio
        case "k2":
            return 0.5 * log_ratio**2
        case "k3":
            return log_ratio.exp() - log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'")


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token, to minimize: -min(r A, clip(r, 1-lo, 1+hi) A).

    logp, old_logp: (N, T); advantages: (N,) or (N, T). Returns (loss (N, T), clipped (N, T) bool).
    """
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = (logp - old_logp).exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()
