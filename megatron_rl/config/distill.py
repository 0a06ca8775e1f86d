"""The distill section: on-policy distillation from a frozen teacher (algorithm.name=distill)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .base import ConfigError


@dataclass(kw_only=True)
class DistillConfig:
    teacher: str = ""
    """The teacher: our checkpoint or run directory, or a Hugging Face directory of a supported family (any
    size); it must share the student's tokenizer."""
    teachers: dict[str, str] = field(default_factory=dict)
    """Several teachers (multi-teacher on-policy distillation, MOPD), name:path pairs; each data row names
    its teacher in its 'teacher' field. Each token's advantage is then stop-gradient(log p_teacher -
    log p_student) of the sampled token, in the policy loss of the GRPO loop (algorithm.* clip and
    mismatch correction settings apply); no reward, no top-k."""
    topk: int = 64
    """The teacher's top-k tokens per position on which the loss is computed (at most the vocabulary)."""
    kl_type: Literal["forward", "reverse", "mixed"] = "forward"
    """forward: KL(teacher || student), mean-seeking; reverse: KL(student || teacher), mode-seeking; mixed:
    mixed_kl_weight x forward + (1 - mixed_kl_weight) x reverse."""
    mixed_kl_weight: float = 0.5
    """The forward KL's weight in kl_type=mixed."""
    cross_tokenizer: bool = False
    """The teacher has another tokenizer: both tokenize the response text, tokens are grouped into chunks
    ending where both have a boundary, and the student matches the teacher's likelihood of each chunk
    (approximate likelihood matching, ALM); topk, kl_type and renormalize_student do not apply."""
    chunk_temperature: float = 1.0
    """Cross-tokenizer: chunk likelihoods are compared as exp(log-likelihood / chunk_temperature)."""
    renormalize_student: bool = False
    """Renormalize the student over the teacher's top-k as well (NeMo RL's default): blind to the student's
    mass outside the top-k. Off: the student's full-vocabulary log-probs, gathered at the top-k."""

    def validate(self):
        if bool(self.teacher) == bool(self.teachers):
            raise ConfigError("algorithm.name=distill needs a teacher: set distill.teacher to our checkpoint or run "
                              "directory, or a Hugging Face directory (or distill.teachers=name:path,... for several, "
                              "not both).")
        if self.topk < 1:
            raise ConfigError(f"distill.topk={self.topk} must be at least 1 (64 is usual).")
        if self.cross_tokenizer and self.teachers:
            raise ConfigError("distill.cross_tokenizer=true takes one teacher (distill.teacher); several teachers "
                              "(distill.teachers) must share the student's tokenizer.")
        if self.chunk_temperature <= 0:
            raise ConfigError(f"distill.chunk_temperature={self.chunk_temperature} must be positive (1 is usual).")
        if not 0 <= self.mixed_kl_weight <= 1:
            raise ConfigError(f"distill.mixed_kl_weight={self.mixed_kl_weight} must be in [0, 1].")
