"""The train and fp8 sections: the loop's length, precision and FP8 GEMMs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import ConfigError


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = 100
    """Optimizer steps of the run (GRPO: rollout batches)."""
    seed: int = 1234
    """Seed of the model's initialization and of megatron's RNG tracker."""
    eval_every: int = 50
    """Evaluate every N steps (and at the end); 0 means only at the end."""
    eval_generate: bool = True
    """Also decode the validation prompts greedily and report val/accuracy (exact match)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """'auto' is bf16 on GPU and fp32 on CPU."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute: 'selective' recomputes attention's core, 'full' each layer in the backward."""
    threads: int = 0
    """CPU threads of each process (torch.set_num_threads); a run's numbers depend on it on the
    CPU, so the tiny recipes pin it. 0 leaves torch's default (OMP_NUM_THREADS)."""
    max_skipped_steps: int = 10
    """An optimizer step whose loss or gradient norm is NaN or Inf applies no update (counted in
    train/skipped_steps); after this many in a row the run stops, keeping its last checkpoint."""
    hang_timeout_s: float = 600
    """With several processes: when no rank has made progress for this long (a rank froze and the
    others wait for it), the frozen rank prints its stacks and every rank exits; a rank that died or
    raised stops the others within seconds. 0: off. Collective timeouts stay long."""


@dataclass(kw_only=True)
class FP8Config:
    """FP8 GEMMs through Transformer Engine (GPUs only; megatron-core's fp8_* settings)."""

    format: Literal["off", "e4m3", "hybrid"] = "off"
    """'e4m3' everywhere, or 'hybrid' (e4m3 forward, e5m2 gradients); 'off': bf16."""
    recipe: Literal["tensorwise", "delayed", "blockwise", "mxfp8"] = "tensorwise"
    """Scaling: per-tensor current ('tensorwise', Hopper and Blackwell), per-tensor from an amax
    history ('delayed'), 128-element blocks ('blockwise', Hopper, CUDA >= 12.9) or MXFP8's 32-element
    blocks ('mxfp8', Blackwell only)."""
    bf16_first_layers: int = 0
    """Transformer layers at the start kept in bf16 (not with recipe=delayed)."""
    bf16_last_layers: int = 0
    """Transformer layers at the end kept in bf16 (not with recipe=delayed)."""
    param: bool = False
    """Keep the GEMM weights themselves in FP8 (less memory; megatron's fp8_param)."""

    def validate(self):
        if self.format == "off":
            return
        if min(self.bf16_first_layers, self.bf16_last_layers) < 0:
            raise ConfigError("fp8.bf16_first_layers and fp8.bf16_last_layers must be >= 0.")
        if self.recipe == "delayed" and (self.bf16_first_layers or self.bf16_last_layers):
            raise ConfigError("fp8.recipe=delayed cannot keep the first or last layers in bf16 (megatron-core refuses "
                              "it): use fp8.recipe=tensorwise or blockwise, or set fp8.bf16_first_layers and "
                              "fp8.bf16_last_layers to 0.")
