"""The optimizer and scheduler sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import ConfigError, positive


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adam", "sgd"] = "adam"
    """adam (megatron's Adam, with decoupled weight decay) or sgd."""
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 0.0
    """The learning rate at the end of the decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.95
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    distributed: bool = False
    """Megatron's distributed optimizer: shard optimizer state over data-parallel ranks."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """Adam's two moments in bf16 instead of fp32: megatron's precision-aware optimizer (Transformer
    Engine's FusedAdam, which then also keeps the fp32 main weights as 16-bit remainders of the bf16
    weights): 6 bytes of state per parameter instead of 12. Needs the distributed optimizer, bf16
    training and a GPU."""
    cpu_offload: float = 0.0
    """Share of the optimizer state kept in host memory and updated by the CPU (megatron's
    HybridDeviceOptimizer, copies overlapped with the update): 0 off, 1 all of it. Host memory per
    GPU: 16 bytes per offloaded parameter of its shard. Needs the distributed optimizer and a GPU."""

    def precision_aware_setting(self) -> str:
        """The setting that runs megatron-core's precision-aware optimizer, as a user writes it
        ('optimizer.state_dtype=bf16' or 'optimizer.cpu_offload'), or '' when neither is on."""
        if self.state_dtype == "bf16":
            return "optimizer.state_dtype=bf16"
        return "optimizer.cpu_offload" if self.cpu_offload else ""

    def validate(self, precision: str = "auto"):
        positive(self, "lr")
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr} exceeds optimizer.lr={self.lr}; lower min_lr.")
        if not 0 <= self.cpu_offload <= 1:
            raise ConfigError(f"optimizer.cpu_offload={self.cpu_offload} is the share of the optimizer state moved to "
                              "host memory: give a number in [0, 1].")
        if self.state_dtype == "bf16" and self.cpu_offload:
            raise ConfigError("optimizer.state_dtype=bf16 and optimizer.cpu_offload do not combine (megatron-core's "
                              "offloaded optimizer keeps fp32 state): choose one.")
        if what := self.precision_aware_setting():
            if not self.distributed or self.name != "adam":
                raise ConfigError(f"{what} works on megatron-core's distributed Adam: set optimizer.distributed=true "
                                  "(and optimizer.name=adam).")
            if precision == "fp32":
                raise ConfigError(f"{what} is for bf16 training (train.precision=bf16 or auto on a GPU); with "
                                  "train.precision=fp32 keep optimizer.state_dtype=fp32 and optimizer.cpu_offload=0.")


@dataclass(kw_only=True)
class SchedulerConfig:
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to optimizer.lr."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """The decay after warmup, to optimizer.min_lr over decay_steps."""
    decay_steps: int = 0
    """Steps from the start to the end of decay; 0 means train.max_steps."""
