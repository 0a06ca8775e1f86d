"""The algorithm section: GRPO and its family, DPO, reward models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = "sft"
    """Which loop in megatron_rl/algorithms/ runs: sft, grpo, dpo, rm (reward model), distill or ppo (with a
    critic; the clip, epochs, minibatches, KL and mismatch settings below apply to it as to GRPO)."""
    early_stop_patience: int = 0
    """Stop after this many evaluations without a better val/loss (SFT, DPO, reward models); 0 means never."""
    prompts_per_step: int = 32
    """GRPO: prompts per step over all data-parallel ranks; each gets rollout.n samples."""
    minibatches: int = 1
    """GRPO: optimizer steps per rollout batch per epoch (the batch is split into this many)."""
    router_replay: bool = False
    """GRPO with MoE: the experts each token was routed to in the rollout are used in the old-policy,
    reference and training forwards and the backward (R3); off: their mismatch is measured."""
    epochs: int = 1
    """GRPO: passes over each rollout batch; the rollout-time policy stays the old policy."""
    clip_low: Optional[float] = None
    """GRPO: the ratio is clipped to [1 - clip_low, 1 + clip_high]. Unset (none): 0.2 for policy_loss=ppo;
    1.0 for cispo, whose importance weight has no lower bound (MiniMax-M1)."""
    clip_high: Optional[float] = None
    """Unset (none): 0.2 for policy_loss=ppo; 4.0 for cispo, capping its weight at 5 (TRL's CISPO
    epsilon_high=5.0 is this absolute cap: clip_high = epsilon_high - 1)."""
    kl_coef: float = 0.0
    """GRPO: weight of the KL penalty to the reference (the initial policy); 0 turns it and the
    reference model off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token KL estimate to the reference: k1 (log ratio), k2 (half its square) or k3 (Schulman's unbiased,
    non-negative)."""
    baseline: Literal["mean", "loo"] = "mean"
    """GRPO advantage baseline: the group mean, or leave-one-out (the mean of the other samples)."""
    std_normalization: Literal["group", "batch", "none"] = "group"
    """GRPO: divide advantages by the group's reward std, the whole batch's (over all data-parallel
    ranks), or not at all."""
    advantage_estimator: Literal["grpo", "gdpo", "rloo", "reinforce_pp"] = "grpo"
    """grpo: baseline and std_normalization below. gdpo: each named reward component normalized within
    its group, weighted (rewards.weights), summed, then normalized over the global batch (needs a reward
    function returning components). rloo: the leave-one-out baseline without std scaling, r_i - mean of
    the group's other rewards (an alias of baseline=loo with std_normalization=none). reinforce_pp:
    REINFORCE++ with a baseline, r_i - group mean on every token, minus kl_coef x each token's KL to the
    reference (the KL moves from the loss into the reward), whitened over all tokens of the global batch."""
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    """ppo: the clipped surrogate. cispo: the clipped importance weight as a stop-gradient
    coefficient on the log-probability (MiniMax-M1), so clipped tokens still learn."""
    ratio_level: Literal["token", "sequence"] = "token"
    """sequence: one importance ratio per sequence, the geometric mean of its token ratios (GSPO);
    clip_low/clip_high then clip that ratio (GSPO uses about 3e-4 / 4e-4)."""
    dual_clip: float = 0.0
    """PPO dual clip: for negative advantages the objective is bounded below by dual_clip x A
    (> 1, e.g. 3); 0 turns it off."""
    loss_aggregation: Literal["token", "sequence", "constant"] = "token"
    """token: mean over all tokens of the global batch (DAPO). sequence: mean over each sequence's
    tokens, then over sequences (GRPO). constant: token sum / (sequences x rollout.max_new_tokens)
    (Dr. GRPO, with std_normalization=none)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the batch is full."""
    dynamic_sampling_rounds: int = 4
    """Extra sampling rounds at most per step; a batch still short is filled with dropped groups."""
    mismatch_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    """Weight each token's loss by p_train / p_rollout of the sampled tokens (per token or per
    sequence), truncated at mismatch_threshold or masked outside [1/threshold, threshold]."""
    mismatch_threshold: float = 2.0
    """Mismatch correction: weights are truncated at it, or tokens masked outside [1/threshold, threshold]."""
    max_staleness: int = 0
    """Disaggregated RL (parallel.rollout_ranks > 0): a step may train on rollouts of weights at most this many
    optimizer steps older than its own, so the generation ranks produce the next batches while the training
    ranks train. 0: every step trains on rollouts of its own weights (generation and training take turns)."""
    off_policy: Literal["decoupled", "rollout_ratio", "none"] = "decoupled"
    """With max_staleness >= 1, how the loss corrects for rollouts of older weights. decoupled (AReaL's
    decoupled PPO): the ratio and its clip against the proximal policy (this step's weights before its
    update: the old logprobs), each token's loss weighted by min(p_proximal / p_rollout, mismatch_threshold)
    (mismatch_correction's weights where it is set, else token_truncate's). rollout_ratio: the ratio
    p / p_rollout itself, clipped (the behaviour policy as the old policy). none is refused."""
    beta: float = 0.1
    """DPO: the strength of the implicit KL constraint to the reference (TRL's beta)."""
    preference_loss: Literal["sigmoid", "cdpo", "robust", "ipo", "hinge"] = "sigmoid"
    """DPO: sigmoid -log s(beta x) (Rafailov et al.); cdpo (conservative DPO) and robust (rDPO, TRL's
    robust), which assume a share label_smoothing of flipped labels; ipo (x - 1/(2 beta))^2 on per-token
    mean log-ratios (Azar et al.); or hinge max(0, 1 - beta x) (SLiC); x is the chosen minus the
    rejected log-ratio to the reference."""
    label_smoothing: float = 0.0
    """DPO with preference_loss cdpo or robust: the assumed share e of flipped labels, in [0, 0.5).
    cdpo: -(1 - e) log s(beta x) - e log s(-beta x); robust: (-(1 - e) log s(beta x) + e log s(-beta x))
    / (1 - 2e)."""
    average_logprobs: Optional[bool] = None
    """DPO: log-ratios as per-token means over the response instead of sums; unset (none) means
    true for ipo and false otherwise."""
    sft_loss_weight: float = 0.0
    """DPO: add this times the mean NLL of the chosen responses' tokens (TRL's rpo_alpha)."""
    precompute_reference: bool = False
    """DPO: compute the reference log-probs of every pair once before training (cached in the run
    directory) and free the reference model."""
    center_rewards_coefficient: float = 0.0
    """Reward model: add this times mean((r_c + r_r)^2), keeping scores centered at 0 (TRL's;
    0.01 is a common value)."""

    def stale(self) -> bool:
        """Whether steps may train on rollouts of older weights (algorithm.max_staleness >= 1)."""
        return self.max_staleness > 0

    def correction(self) -> str:
        """The mismatch correction in force: mismatch_correction, or token_truncate for stale rollouts with
        off_policy=decoupled where none is set."""
        if self.stale() and self.off_policy == "decoupled" and self.mismatch_correction == "none":
            return "token_truncate"
        return self.mismatch_correction

    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high), the unset ones at the policy loss's defaults."""
        low, high = (1.0, 4.0) if self.policy_loss == "cispo" else (0.2, 0.2)
        return (low if self.clip_low is None else self.clip_low), (high if self.clip_high is None else self.clip_high)

