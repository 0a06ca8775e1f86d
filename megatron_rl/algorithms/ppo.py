"""PPO with a learned critic (InstructGPT's recipe, as TRL's PPOTrainer and NeMo RL run it): the GRPO
loop (algorithms/grpo.py: rollout, scoring, old and reference logprobs, the clipped policy loss)
with advantages from a critic instead of from groups.

Per step, after the rollout and the reference's logprobs:
- each response token's reward is -algorithm.kl_coef x its KL estimate to the reference (k1/k2/k3
  of the rollout's logprobs), plus the sequence's score at its last token (losses.token_rewards);
- the critic (training/critic.py) gives the old values V_t, gathered whole over context parallelism;
- GAE (ppo.gamma, ppo.lam) gives advantages and returns R_t = A_t + V_t; the advantages are then
  whitened over the response tokens of the global batch (all data-parallel ranks);
- the critic learns first: algorithm.epochs x minibatches steps of the clipped value loss
  (ppo.value_clip), a mean over the global batch's response tokens; then the policy, as in GRPO (for
  the first ppo.critic_warmup_steps steps only the critic).
rollout.n samples per prompt are allowed (each is its own episode); n=1 is classic PPO.
"""

from functools import partial
from pathlib import Path

from megatron_rl import checkpointing, losses
from megatron_rl.algorithms import grpo
from megatron_rl.config import Config
from megatron_rl.training import critic as critic_lib
from megatron_rl.training.policy import RLBatch, optimizer_passes
from megatron_rl.training.stats import dp_sum


class Critic:
    """What PPO adds to the GRPO loop: the critic, its advantages, its update and its checkpoints."""

    def __init__(self, cfg: Config, run_dir: Path, resumed_step: int | None):
        self.cfg, self.run_dir = cfg, run_dir
        self.trainee, self.critic_cfg = critic_lib.build_critic(cfg, run_dir, resumed_step)

    def advantages(self, scored, batch: RLBatch):
        """Per-token advantages (N, S); batch gains the critic's old values and the returns."""
        a, p = self.cfg.algorithm, self.cfg.ppo
        mask = batch.loss_mask
        kl = losses.kl_penalty(batch.unfiltered_rollout_logp, batch.ref_logp, a.kl_estimator) if a.kl_coef else None
        rewards = losses.token_rewards(scored.shaped, mask, kl, a.kl_coef)
        values = critic_lib.values_of(self.trainee.model, batch.tensors(), self.cfg) * mask
        advantages, returns = losses.gae(rewards, values, mask, p.gamma, p.lam)
        batch.old_values, batch.returns = values, returns.float()
        if p.whiten_advantages:
            advantages = losses.whiten(advantages, mask, dp_sum)
        return advantages.float()

    def train(self, batch: RLBatch) -> dict:
        sums, grad_norms = optimizer_passes(self.trainee, self.critic_cfg,
                                            batch.tensors("tokens", "loss_mask", "old_values", "returns"),
                                            partial(critic_lib.critic_loss, self.cfg.ppo.value_clip))
        return critic_lib.critic_metrics(sums, grad_norms)

    def warming_up(self, step: int) -> bool:
        return step < self.cfg.ppo.critic_warmup_steps

    def save(self, step: int):
        c = self.cfg.checkpoint
        checkpointing.save(self.trainee, critic_lib.critic_dir(self.run_dir), step, {}, c.keep,
                           model=self.critic_cfg.model, verify=c.verify)


def run(cfg: Config, run_dir: Path) -> dict:
    return grpo.run(cfg, run_dir, critic_class=Critic)
