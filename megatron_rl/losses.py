"""Advantages and policy losses: pure functions of tensors (no model, no config, no distributed state).

Shapes: (N,) per sample, (N, T) per token with a 0/1 `mask` of the tokens that count.
"""

import torch
import torch.nn.functional as F


def _local(t: torch.Tensor) -> torch.Tensor:
    return t


def _moments(x: torch.Tensor, mask: torch.Tensor | None = None, reduce=_local) -> tuple[torch.Tensor, ...]:
    """Mean, population variance and count of x (where mask) over the whole batch: reduce sums the
    vector [sum, sum of squares, count] over the ranks holding the rest of it."""
    x = x.double()
    m = torch.ones_like(x) if mask is None else mask.double()
    s = reduce(torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]))
    mean = s[0] / s[2]
    return mean, (s[1] / s[2] - mean**2).clamp(min=0), s[2]


def _unbiased_std(var: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The unbiased standard deviation (as torch.std) from a population variance over n values."""
    return (var * n / (n - 1)).sqrt()


def group_advantages(rewards: torch.Tensor, group_size: int, baseline: str = "mean", std: str = "group",
                     eps: float = 1e-6, reduce=_local) -> torch.Tensor:
    """GRPO advantages: each sample's reward minus its group's baseline, optionally scaled.

    rewards: (N,), groups are consecutive runs of `group_size` samples (one prompt each).
    baseline: 'mean' (group mean) or 'loo' (mean of the other samples of the group).
    std: 'group' (divide by the group's std), 'batch' (by the whole batch's std: reduce sums moments
    over the data-parallel ranks) or 'none'.
    RLOO is baseline='loo', std='none': A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_j r_j).
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
            _, var, n = _moments(r, reduce=reduce)
            adv = adv / (_unbiased_std(var, n) + eps)
        case "none":
            pass
        case _:
            raise ValueError(f"unknown std normalization {std!r}; use 'group', 'batch' or 'none'")
    return adv.reshape(-1).to(rewards.dtype)


def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, mask: torch.Tensor,
                            kl: torch.Tensor | None = None, kl_coef: float = 0.0, reduce=_local) -> torch.Tensor:
    """REINFORCE++ with a baseline (NeMo RL's reinforce_plus_plus with minus_baseline), per token (N, T):
    each sample's reward minus its group's mean, on every token of its response; minus kl_coef x the
    token's KL estimate to the reference (per token, not accumulated over the sequence); then whitened
    over the valid tokens of the whole batch (reduce sums moments over the data-parallel ranks):
    (a - mean) / sqrt(max(var, 1e-8)). Tokens outside the mask get 0."""
    r = rewards.reshape(-1, group_size).double()
    adv = (r - r.mean(dim=1, keepdim=True)).reshape(-1, 1).expand(mask.shape).clone()
    if kl is not None:
        adv = adv - kl_coef * kl.double()
    return whiten(adv, mask, reduce).to(rewards.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, reduce=_local) -> torch.Tensor:
    """(x - mean) / sqrt(max(var, 1e-8)) over the valid tokens of the whole batch (reduce sums the
    moments over the data-parallel ranks); 0 outside the mask."""
    mean, var, _ = _moments(x, mask, reduce)
    return (x - mean) * var.clamp(min=1e-8).rsqrt() * mask


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """PPO's per-token reward (N, T) as InstructGPT and TRL define it: -kl_coef x each response token's KL
    estimate to the reference, plus the sequence's score (N,) at its last response token."""
    last = (torch.arange(mask.shape[1]) * (mask > 0)).argmax(dim=1)
    r = torch.zeros(mask.shape, dtype=torch.float64)
    r[torch.arange(len(mask)), last] = scores.double() * (mask.sum(dim=1) > 0)
    if kl is not None:
        r = r - kl_coef * kl.double() * mask
    return r


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's response tokens (mask 1): with V after the last
    response token 0,
        delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   R_t = A_t + V_t,
    where t+1 is the next response token: masked positions inside a response (a multi-turn episode's
    observations) are skipped, not ends. values[t] is the critic's value of the state that chose
    token t (the critic's output at the position whose label is that token, as logprobs are). Returns
    (advantages, returns), (N, T) float64, 0 outside the mask."""
    m, r, v = mask.double(), rewards.double(), values.double() * mask.double()
    adv = torch.zeros_like(r)
    carry = next_value = torch.zeros(len(r), dtype=torch.float64)
    for t in reversed(range(r.shape[1])):
        on = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        carry = torch.where(on, delta + gamma * lam * carry, carry)
        next_value = torch.where(on, v[:, t], next_value)
        adv[:, t] = carry * m[:, t]
    return adv, adv + v


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss 0.5 max((V - R)^2, (clip(V, V_old +- clip) - R)^2) (PPO's; clip 0:
    the plain squared error), and where the clipped term was the larger."""
    loss = (values - returns) ** 2
    if not clip:
        return 0.5 * loss, torch.zeros_like(loss, dtype=torch.bool)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(loss, clipped), clipped > loss


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


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    return advantages[:, None] if advantages.dim() == 1 else advantages


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        clip_low: float = 0.2, clip_high: float = 0.2,
                        dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, per token, to minimize: -min(r A, clip(r, 1-lo, 1+hi) A).

    Clip-higher (DAPO): clip_high > clip_low. Dual clip (Ye et al. 2020): for A < 0 the objective
    is also bounded below by dual_clip * A (dual_clip > 1; 0 turns it off).
    logp, old_logp: (N, T); advantages: (N,) or (N, T). Returns (loss (N, T), clipped (N, T) bool):
    clipped marks tokens whose gradient a clip removed.

    With stale rollouts and algorithm.off_policy=rollout_ratio, old_logp is the behaviour policy's (the
    rollout's own logprobs, weights up to max_staleness steps old): r = pi / mu, and the clip truncates
    the importance ratio against the policy that sampled (PipelineRL's and verl's one-step-off objective).
    """
    adv = _per_token(advantages)
    ratio = (logp - old_logp).exp()
    unclipped = ratio * adv
    clipped_term = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    objective = torch.minimum(unclipped, clipped_term)
    clipped = clipped_term < unclipped
    if dual_clip:
        floor = dual_clip * adv
        dual = (adv < 0) & (objective < floor)
        objective = torch.where(dual, floor, objective)
        clipped = clipped | dual
    return -objective, clipped


def gspo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean of its token
    ratios s = exp(mean_t(logp - old_logp)), clipped to [1-lo, 1+hi]; per sequence -min(s A, clip(s) A).

    advantages: (N,). Returned per token (N, T): every valid token carries its sequence's loss, so
    'sequence' aggregation (the mean over a sequence's tokens, then over sequences) gives GSPO's
    mean over sequences. A fully masked sequence contributes 0.
    """
    lengths = mask.sum(dim=1).clamp(min=1)  # (N,)
    s = (((logp - old_logp) * mask).sum(dim=1) / lengths).exp()  # (N,)
    unclipped = s * advantages
    clipped_term = s.clamp(1 - clip_low, 1 + clip_high) * advantages
    seq_loss = -torch.minimum(unclipped, clipped_term)  # (N,)
    clipped = (clipped_term < unclipped)[:, None].expand_as(mask)
    return seq_loss[:, None] * mask, clipped


def cispo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): the clipped importance weight is a stop-gradient coefficient on the
    log-probability, so every token keeps a gradient: per token -sg(clip(r, 1-lo, 1+hi)) A log p."""
    ratio = (logp - old_logp).exp()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    return -weight * _per_token(advantages) * logp, clipped


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int = 0,
              seq_tokens: torch.Tensor | None = None, count_sequences: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of a batch loss; the loss of a batch is numerator / denominator, and
    both add up over microbatches and data-parallel ranks (megatron divides by the global sum).

    'token' (DAPO): mean over all valid tokens of the batch. 'sequence' (GRPO): mean over tokens of
    each sequence, then over sequences. 'constant' (Dr. GRPO): token sum / (sequences x max_len).
    When the ranks of a context-parallel group each hold part of every sequence, seq_tokens (B,)
    gives each sequence's whole valid-token count and only one of them counts the sequences.
    """
    seq_tokens = mask.sum(dim=1) if seq_tokens is None else seq_tokens
    sequences = (seq_tokens > 0).sum().to(mask.dtype) * count_sequences
    match mode:
        case "token":
            return masked_sum(loss, mask), mask.sum()
        case "sequence":
            return (masked_sum_rows(loss, mask) / seq_tokens.clamp(min=1)).sum(), sequences
        case "constant":
            if max_len <= 0:
                raise ValueError("'constant' aggregation needs the maximum response length")
            return masked_sum(loss, mask) / max_len, sequences
    raise ValueError(f"unknown loss aggregation {mode!r}; use 'token', 'sequence' or 'constant'")


def masked_sum_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(dim=1)


def mismatch_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                     threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights w = p_train / p_rollout of the sampled tokens, correcting for the rollout
    engine's distribution differing from the training forward's (Yao et al. 2025).

    mode: 'token_truncate' (w_t capped at threshold), 'token_mask' (tokens with w_t outside
    [1/threshold, threshold] get weight 0), 'sequence_truncate' / 'sequence_mask' (the same with
    the sequence weight prod_t w_t, for every token of the sequence). Returns (weights (N, T),
    masked (N, T) bool). The weights carry no gradient.

    The same weights correct stale rollouts (algorithm.max_staleness >= 1, off_policy=decoupled: AReaL's
    decoupled PPO, Fu et al. 2025). With the behaviour policy mu (the rollout's weights, up to k steps
    old) and the proximal policy pi_prox (this step's weights before its update: `old_logp`), the
    per-token objective is
        min(pi_prox / mu, threshold) * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),  r = pi / pi_prox,
    so the clip bounds the update against the proximal policy, while the truncated behaviour weight
    corrects for the samples having come from mu.
    """
    log_w = ((old_logp - rollout_logp) * mask).detach()
    kind, _, action = mode.partition("_")
    if kind == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(mask)
    elif kind != "token" or action not in ("truncate", "mask"):
        raise ValueError(f"unknown mismatch correction {mode!r}; use token_ or sequence_ with truncate or mask")
    w = log_w.exp()
    if action == "truncate":
        return w.clamp(max=threshold) * mask, torch.zeros_like(mask, dtype=torch.bool)
    outside = ((w > threshold) | (w < 1 / threshold)) & (mask > 0)
    return torch.where(outside, 0.0, w) * mask, outside


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_len - buffer, then falling
    linearly to -penalty at max_len (and -penalty beyond)."""
    start = max_len - buffer
    return -penalty * ((lengths.float() - start) / buffer).clamp(min=0.0, max=1.0)


def gdpo_advantages(components: torch.Tensor, weights: torch.Tensor, group_size: int,
                    eps: float = 1e-6, reduce=_local) -> torch.Tensor:
    """GDPO: each reward component (N, K) normalized within its group (mean 0, std 1), then the
    weighted sum over components, then normalized over the whole batch (reduce sums moments over the
    data-parallel ranks)."""
    k = components.shape[1]
    c = components.double().reshape(-1, group_size, k)  # (groups, G, K)
    normed = (c - c.mean(dim=1, keepdim=True)) / (c.std(dim=1, keepdim=True) + eps)
    total = (normed * weights.double()).sum(dim=-1).reshape(-1)  # (N,)
    mean, var, n = _moments(total, reduce=reduce)  # one reduction over the ranks
    return ((total - mean) / (_unbiased_std(var, n) + eps)).to(components.dtype)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic sampling filter: (groups,) True where the group's rewards are not all equal."""
    r = rewards.reshape(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


# --- preferences: DPO and reward models -------------------------------------------------------


def preference_loss(delta_chosen: torch.Tensor, delta_rejected: torch.Tensor, beta: float, kind: str = "sigmoid",
                    label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss (N,) of the DPO family from each response's log-ratio to the reference,
    delta = sum_t (log pi(y_t) - log pi_ref(y_t)) over its tokens (or the per-token mean), x = delta_c - delta_r.

    'sigmoid' (DPO, Rafailov et al. 2023): -log s(beta x). With label smoothing e, the assumed share of
    flipped labels: 'cdpo' (conservative DPO, Mitchell 2023) -(1 - e) log s(beta x) - e log s(-beta x),
    and 'robust' (rDPO, Chowdhury et al. 2024; TRL's robust) the unbiased
    (-(1 - e) log s(beta x) + e log s(-beta x)) / (1 - 2e). 'ipo' (Azar et al. 2023):
    (x - 1 / (2 beta))^2, on per-token mean log-ratios. 'hinge' (SLiC): max(0, 1 - beta x).
    """
    x = delta_chosen - delta_rejected
    e = label_smoothing
    match kind:
        case "sigmoid":
            return -F.logsigmoid(beta * x)
        case "cdpo":
            return -(1 - e) * F.logsigmoid(beta * x) - e * F.logsigmoid(-beta * x)
        case "robust":
            return (-(1 - e) * F.logsigmoid(beta * x) + e * F.logsigmoid(-beta * x)) / (1 - 2 * e)
        case "ipo":
            return (x - 1 / (2 * beta)) ** 2
        case "hinge":
            return torch.relu(1 - beta * x)
    raise ValueError(f"unknown preference loss {kind!r}; use 'sigmoid', 'cdpo', 'robust', 'ipo' or 'hinge'")


def bradley_terry_loss(score_chosen: torch.Tensor, score_rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center_coefficient: float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss (N,): -log s(r_c - r_r - margin), plus c (r_c + r_r)^2 when
    centering (TRL's center_rewards_coefficient), which pins the scores' free offset near 0."""
    diff = score_chosen - score_rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coefficient:
        loss = loss + center_coefficient * (score_chosen + score_rejected) ** 2
    return loss


OUTSIDE_TOPK_LOGPROB = -100.0
"""The teacher's log-probability assumed outside its top-k set in the reverse KL of a student that is not
renormalized (NeMo RL's convention): the student's mass there is penalized, not ignored."""


def distill_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kind: str = "forward",
               forward_weight: float = 0.5, student_neg_entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL between teacher and student on the teacher's top-k set S, (B, S) from (B, S, k).

    teacher_logp: the teacher's log-probs renormalized over S (q). student_logp: the student's log-probs
    at S (p), of the full vocabulary, or renormalized over S too (then leave student_neg_entropy None).
      forward  = sum_S q (log q - log p)
      reverse  = sum_S p (log p - log q) [+ sum_{not S} p (log p - OUTSIDE_TOPK_LOGPROB), given
                 student_neg_entropy = sum over the whole vocabulary of p log p]
      mixed    = forward_weight x forward + (1 - forward_weight) x reverse
    Temperature 1: the loss does not depend on how the student sampled."""
    forward = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(dim=-1)
    if kind == "forward":
        return forward
    p = student_logp.exp()
    reverse = (p * (student_logp - teacher_logp)).sum(dim=-1)
    if student_neg_entropy is not None:
        outside_plogp = student_neg_entropy - (p * student_logp).sum(dim=-1)
        reverse = reverse + outside_plogp - OUTSIDE_TOPK_LOGPROB * (1 - p.sum(dim=-1))
    if kind == "reverse":
        return reverse
    if kind == "mixed":
        return forward_weight * forward + (1 - forward_weight) * reverse
    raise ValueError(f"unknown distillation KL {kind!r}; known: forward, reverse, mixed")


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler's switch at -log 2)."""
    x = x.clamp(max=-1e-6)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def chunk_likelihood_loss(student_logp: torch.Tensor, teacher_logp: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Approximate likelihood matching (ALM, Minixhofer et al. 2025) per aligned chunk: the two models'
    log-likelihoods of the same piece of text, each read as a Bernoulli probability p = exp(logp / T),
    compared by the binary KL(teacher || student) = q log(q / p) + (1 - q) log((1 - q) / (1 - p))."""
    s, t = student_logp / temperature, teacher_logp / temperature
    q = t.exp()
    return q * (t - s) + (1 - q) * (_log1mexp(t) - _log1mexp(s))
