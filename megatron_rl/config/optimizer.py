"""The optimizer and scheduler sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .base import ConfigError, positive


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adam", "sgd", "muon"] = "adam"
    """adam (megatron's Adam, with decoupled weight decay), sgd, or muon: Muon (orthogonalized momentum) for
    the hidden layers' 2-D weights (attention, MLP, experts, routers, Mamba projections, LoRA adapters) and
    Adam for the rest (embedding, output layer or score head, norms, biases, convolutions), as
    megatron-core's Muon wrapper groups them; lr, weight_decay and clip_grad apply to both, beta1, beta2
    and eps to Adam's part. With optimizer.distributed each data-parallel rank updates whole matrices
    (megatron-core's layer-wise distributed optimizer)."""
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
    muon_momentum: float = 0.95
    """Muon's momentum, in [0, 1)."""
    muon_nesterov: bool = True
    """Muon's Nesterov momentum: orthogonalize g + momentum * buffer rather than the buffer."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations that orthogonalize each matrix's update (1 to 99)."""
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    """The quintic Newton-Schulz iteration's a,b,c (Keller Jordan's, torch.optim.Muon's default)."""
    muon_ns_dtype: Literal["fp32", "bf16"] = "fp32"
    """The Newton-Schulz matmuls' dtype: fp32 (megatron-core's Muon) or bf16 (torch.optim.Muon's, faster
    on a GPU; then a matrix's update depends on the bf16 rounding of its input, so layouts agree less
    closely)."""
    muon_lr_scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """How a matrix's learning rate follows its shape (A x B, whole over tensor parallelism):
    match_rms_adamw, 0.2 * sqrt(max(A, B)) (Moonshot's: the update's RMS is AdamW's, so an Adam
    recipe's lr and weight_decay carry over); original, sqrt(max(1, A / B)) (Keller Jordan's: lr
    about 0.02)."""
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
        if self.name == "muon":
            self._validate_muon()
        if what := self.precision_aware_setting():
            if self.name == "muon":
                raise ConfigError(f"{what} is Adam's (megatron-core's precision-aware optimizer): Muon keeps one fp32 "
                                  "momentum per matrix on the device; with optimizer.name=muon drop it.")
            if not self.distributed or self.name != "adam":
                raise ConfigError(f"{what} works on megatron-core's distributed Adam: set optimizer.distributed=true "
                                  "(and optimizer.name=adam).")
            if precision == "fp32":
                raise ConfigError(f"{what} is for bf16 training (train.precision=bf16 or auto on a GPU); with "
                                  "train.precision=fp32 keep optimizer.state_dtype=fp32 and optimizer.cpu_offload=0.")

    def _validate_muon(self):
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"optimizer.muon_momentum={self.muon_momentum} is out of range: give a number in [0, 1) "
                              "(0.95 is usual).")
        if not 1 <= self.muon_ns_steps < 100:
            raise ConfigError(f"optimizer.muon_ns_steps={self.muon_ns_steps} is out of range: give 1 to 99 "
                              "Newton-Schulz iterations (5 is usual).")
        if len(self.muon_ns_coefficients) != 3:
            raise ConfigError(f"optimizer.muon_ns_coefficients has {len(self.muon_ns_coefficients)} numbers; the "
                              "quintic iteration takes three, a,b,c (default 3.4445,-4.775,2.0315).")

    def sharded_buffers(self) -> bool:
        """Whether megatron's DistributedOptimizer shards the flat gradient and parameter buffers over
        data-parallel ranks (optimizer.distributed with Adam or SGD). Muon's distributed optimizer is the
        layer-wise one: every rank keeps the whole buffers and updates whole matrices."""
        return self.distributed and self.name != "muon"


@dataclass(kw_only=True)
class SchedulerConfig:
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to optimizer.lr."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """The decay after warmup, to optimizer.min_lr over decay_steps."""
    decay_steps: int = 0
    """Steps from the start to the end of decay; 0 means train.max_steps."""
