"""The optimizer and scheduler sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import ConfigError, positive


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    distributed: bool = False
    """Megatron's distributed optimizer: shard optimizer state over data-parallel ranks."""

    def validate(self):
        positive(self, "lr")
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr} exceeds optimizer.lr={self.lr}; lower min_lr.")


@dataclass(kw_only=True)
class SchedulerConfig:
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: int = 0
    """Steps from the start to the end of decay; 0 means train.max_steps."""
