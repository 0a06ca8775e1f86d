"""The ppo section: PPO with a learned critic (algorithm.name=ppo)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ConfigError


@dataclass(kw_only=True)
class PPOConfig:
    critic: str = ""
    """Where the critic's weights start: empty means the policy's own start (checkpoint.load or
    model.hf_path) with a fresh value head; else our checkpoint or run directory (a reward model keeps its
    score head, a language model gets a fresh one) or a Hugging Face directory of the same architecture."""
    critic_lr: float = 0.0
    """The critic's learning rate (its own Adam, same settings as optimizer.*); 0 means optimizer.lr."""
    gamma: float = 1.0
    """GAE's discount per token."""
    lam: float = 0.95
    """GAE's lambda: 1 is the Monte-Carlo return minus the value, 0 one-step TD."""
    value_clip: float = 0.2
    """The new value is also taken clipped to old value +- value_clip, and the larger squared error counts
    (PPO's value clipping); 0 turns it off."""
    critic_warmup_steps: int = 0
    """Steps at the start in which only the critic learns (the policy stays as it is)."""
    whiten_advantages: bool = True
    """Whiten the GAE advantages over the response tokens of the global batch (after the returns are taken)."""

    def validate(self):
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"ppo.gamma={self.gamma} and ppo.lam={self.lam} must be in [0, 1] (1 and 0.95 are usual).")
        if self.value_clip < 0 or self.critic_lr < 0 or self.critic_warmup_steps < 0:
            raise ConfigError("ppo.value_clip, ppo.critic_lr and ppo.critic_warmup_steps must be >= 0.")
