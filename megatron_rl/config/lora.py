"""The lora section: low-rank adapters around megatron's linear layers (lora.rank > 0 turns them on)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ConfigError


@dataclass(kw_only=True)
class LoRAConfig:
    rank: int = 0
    """Adapter rank r; 0 trains the whole model (no adapters)."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (SFT, DPO and reward models only: a random forward breaks the
    rollout/training agreement of RL algorithms)."""
    targets: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    """Which linear layers get adapters: a module's last name (linear_qkv) or a glob over its full name
    (*.layers.0.*.linear_qkv). MoE experts keep no adapters (a pattern naming experts is refused: not
    supported yet); the attention and shared or dense MLP layers of MoE models get them."""

    adapter: str = ""
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start the adapters from,
    made for this model's architecture with these targets, rank and alpha; empty: fresh adapters."""

    def validate(self):
        if self.adapter and not self.rank:
            raise ConfigError(f"lora.adapter={self.adapter!r} needs lora.rank (and lora.alpha) as the adapter has them.")
        if self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank} must be >= 1 for adapters (0 trains the whole model).")
        if not self.rank:
            return
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be positive (the adapter is scaled by alpha / rank; "
                              f"32 is usual).")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1).")
        if not self.targets:
            raise ConfigError("lora.targets is empty: name the linear layers that get adapters "
                              "(linear_qkv, linear_proj, linear_fc1, linear_fc2, or glob patterns).")
