"""The parallel section: how ranks split the model and the data."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ConfigError, positive
from .model import ModelConfig


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    vpp: int = 1
    """Model chunks per pipeline stage (virtual pipeline / interleaved 1F1B); 1 means off."""
    cp: int = 1
    """Context parallel size."""
    ep: int = 1
    """Expert parallel size (MoE): experts are split over this many ranks of tp x cp x dp."""
    etp: int = 0
    """Tensor parallel size inside each expert; 0 means the same as tp."""
    sp: bool = False
    """Sequence parallel (needs tp > 1)."""
    dp: int = 0
    """Data parallel size; 0 means whatever the world size leaves after tp x pp x cp."""
    rollout_ranks: int = 0
    """Disaggregated RL (GRPO family, PPO): the job's last rollout_ranks ranks only generate, on a copy of the
    policy in their own layout (rollout_tp, rollout_ep) that the training ranks hand their weights to after
    every optimizer step; the other ranks only train, in the layout this section gives. 0: every rank rolls
    out and trains, in turn."""
    rollout_tp: int = 1
    """Tensor parallel size of the generation ranks (parallel.rollout_ranks)."""
    rollout_ep: int = 1
    """Expert parallel size of the generation ranks (MoE)."""
    first_stage_layers: int = 0
    """Uneven pipeline: layers of the first stage (0: an even split); the middle stages share the rest."""
    last_stage_layers: int = 0
    """Uneven pipeline: layers of the last stage (0: an even split)."""

    def validate(self, world_size: int, model: ModelConfig | None = None):
        positive(self, "tp", "pp", "vpp", "cp", "ep")
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp x pp x cp = {self.tp} x {self.pp} x "
                f"{self.cp} = {model_parallel}; launch a multiple of {model_parallel} processes "
                f"(torchrun --nproc_per_node N) or change parallel.tp/pp/cp.")
        dp = world_size // model_parallel
        if self.dp and self.dp != dp:
            raise ConfigError(
                f"parallel.dp={self.dp} but world size {world_size} / (tp x pp x cp = {model_parallel}) "
                f"= {dp}; launch {self.dp * model_parallel} processes or set parallel.dp={dp} (or 0).")
        if self.sp and self.tp == 1:
            raise ConfigError("parallel.sp=true needs parallel.tp > 1; set parallel.sp=false or raise tp.")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1 (it splits each pipeline stage).")
        expert_tp = self.etp or self.tp
        if (self.tp * self.cp * dp) % (self.ep * expert_tp):
            raise ConfigError(
                f"parallel.ep x expert tensor parallel = {self.ep} x {expert_tp} must divide tp x cp x dp = "
                f"{self.tp * self.cp * dp}; lower parallel.ep/etp or launch more processes.")
        if model is None:
            return
        if model.num_experts and self.tp > 1 and not self.sp:
            raise ConfigError("an MoE model with parallel.tp > 1 needs parallel.sp=true (megatron-core requires "
                              "sequence parallelism with experts and tensor parallelism).")
        if self.ep > 1 and (not model.num_experts or model.num_experts % self.ep):
            raise ConfigError(
                f"parallel.ep={self.ep} needs model.num_experts ({model.num_experts}) to be a multiple of it.")
        if model.hybrid_pattern:
            self._validate_hybrid(model)
        groups = model.num_query_groups or model.num_attention_heads
        for what, n in (("num_attention_heads", model.num_attention_heads),
                        ("num_query_groups", groups), ("ffn_hidden_size", model.ffn_hidden_size)):
            if n % self.tp:
                raise ConfigError(
                    f"model.{what}={n} is not divisible by parallel.tp={self.tp}; choose a tp that divides it.")
        if self.first_stage_layers or self.last_stage_layers:
            middle = self.pp - bool(self.first_stage_layers) - bool(self.last_stage_layers)
            rest = model.num_layers - self.first_stage_layers - self.last_stage_layers
            if self.vpp > 1 or middle < 0 or rest < 0 or (rest % middle if middle else rest):
                raise ConfigError(
                    f"parallel.first_stage_layers={self.first_stage_layers} and last_stage_layers="
                    f"{self.last_stage_layers} must leave the other {model.num_layers} - those layers evenly to the "
                    f"{middle} middle stages of parallel.pp={self.pp} (and parallel.vpp=1).")
        elif model.num_layers % (self.pp * self.vpp):
            raise ConfigError(
                f"model.num_layers={model.num_layers} is not divisible by parallel.pp x parallel.vpp = "
                f"{self.pp} x {self.vpp}; choose a layout whose stages get whole layers.")

    def _validate_hybrid(self, model: ModelConfig):
        if self.vpp > 1:
            raise ConfigError("a hybrid model (model.hybrid_pattern) cannot use a virtual pipeline (megatron-core's "
                              "MambaStack refuses it): set parallel.vpp=1.")
        if "M" in model.hybrid_pattern:
            for what in ("mamba_num_heads", "mamba_num_groups"):
                if getattr(model, what) % self.tp:
                    raise ConfigError(f"model.{what}={getattr(model, what)} is not divisible by parallel.tp={self.tp}; "
                                      "choose a tp that divides it.")

    def trainers(self, world_size: int) -> int:
        """The ranks that train: all but parallel.rollout_ranks."""
        return world_size - self.rollout_ranks

    def generation_layout(self, model: ModelConfig | None = None) -> "ParallelConfig":
        """The generation ranks' layout: rollout_tp x rollout_ep over data-parallel copies, one stage (sequence
        parallel where megatron needs it: experts with tensor parallelism)."""
        sp = self.rollout_tp > 1 and (self.sp or bool(model is not None and model.num_experts))
        return ParallelConfig(tp=self.rollout_tp, ep=self.rollout_ep, sp=sp)

    def validate_split(self, world_size: int, model: ModelConfig | None = None):
        """A disaggregated job (rollout_ranks > 0): both sides must have ranks, and the generation layout
        must divide its ranks and the model."""
        if self.rollout_ranks < 0:
            raise ConfigError(f"parallel.rollout_ranks={self.rollout_ranks} must be >= 0 (0: no generation ranks).")
        if not self.rollout_ranks:
            return
        if self.rollout_ranks >= world_size:
            raise ConfigError(f"parallel.rollout_ranks={self.rollout_ranks} leaves no training rank in a job of "
                              f"{world_size} rank(s); launch more processes or lower parallel.rollout_ranks.")
        positive(self, "rollout_tp", "rollout_ep")
        try:
            self.generation_layout(model).validate(self.rollout_ranks, model)
        except ConfigError as e:
            raise ConfigError(f"the generation ranks' layout (parallel.rollout_tp={self.rollout_tp}, rollout_ep="
                              f"{self.rollout_ep} over parallel.rollout_ranks={self.rollout_ranks}): {e}") from None

    def sequence_divisor(self) -> int:
        """What a training sequence's length must be a multiple of: 2 chunks per context-parallel rank,
        times tp with sequence parallelism."""
        return (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sp else 1)

    def recipe_world_size(self) -> int:
        """The processes this layout names: tp x pp x cp x dp (dp 0 counts as 1), plus the generation ranks."""
        return self.tp * self.pp * self.cp * max(self.dp, 1) + self.rollout_ranks

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)
