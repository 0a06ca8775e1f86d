"""Megatron <-> Hugging Face weight mapping: name rules and the pure tensor transforms between them.

Megatron names here are *canonical*: those of a single-process GPTModel built with the local
spec, with global layer numbers and experts named `mlp.experts.{E}.` (megatron_rl/hf/weights.py
maps the names of any TP/PP/EP layout and of Transformer Engine modules onto them). A canonical
tensor is the whole, unsharded tensor, vocabulary padded to a multiple of 128.
"""

import re
from dataclasses import dataclass

import torch

from megatron_rl.config import ModelConfig

from .builder import padded_vocab_size

_FIELD = re.compile(r"\{([LE])\}")


def _pattern(template: str) -> re.Pattern:
    parts = _FIELD.split(template)
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts))
    return re.compile(regex + "$")


@dataclass(frozen=True)
class Rule:
    """One megatron tensor and the HF tensor(s) it is made of.

    kind: 'copy' (same tensor), 'vocab' (rows padded to the megatron vocabulary), 'qkv' (q, k, v
    fused per query group), 'glu' (gate and up stacked), 'expert' (row {E} of an HF tensor that
    stacks all experts, transformers 5's fused layout; import only).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str = "copy"

    def match(self, name: str) -> dict | None:
        m = _pattern(self.megatron).match(name)
        return m.groupdict() if m else None

    def match_hf(self, name: str) -> dict | None:
        for template in self.hf:
            m = _pattern(template).match(name)
            if m:
                return m.groupdict()
        return None

    def hf_names(self, fields: dict) -> list[str]:
        return [_FIELD.sub(lambda m: fields[m.group(1)], t) for t in self.hf]

    def megatron_name(self, fields: dict) -> str:
        return _FIELD.sub(lambda m: fields[m.group(1)], self.megatron)


def rules_for(rules: list[Rule], name: str) -> list[tuple[Rule, dict]]:
    """The rules that make megatron tensor `name`, in order of preference, with their fields."""
    found = []
    for rule in rules:
        fields = rule.match(name)
        if fields is not None:
            found.append((rule, fields))
    return found


# --- transforms: whole tensors in, whole tensors out ----------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF q/k/v projections -> megatron's linear_qkv: per query group, its q heads, then k, then v.

    q: (heads * d, ...), k and v: (groups * d, ...). Works for weights and biases.
    """
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)  # (groups, heads_per_group * d, ...)
    k = k.reshape(groups, -1, *rest)  # (groups, d, ...)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv."""
    rest = qkv.shape[1:]
    d = qkv.shape[0] // (heads + 2 * groups)
    per_group = qkv.reshape(groups, (heads // groups + 2) * d, *rest)
    q, k, v = per_group.split([heads // groups * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Append zero rows up to `rows` (megatron's padded vocabulary)."""
    if t.shape[0] > rows:
        raise ValueError(f"{t.shape[0]} vocabulary rows exceed the model's {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


def to_megatron(rule: Rule, tensors: list[torch.Tensor], model: ModelConfig, fields: dict) -> torch.Tensor:
    """HF tensors -> the canonical megatron tensor of `rule`."""
    match rule.kind:
        case "copy":
            return tensors[0]
        case "vocab":
            return pad_vocab(tensors[0], padded_vocab_size(model.vocab_size))
        case "qkv":
            return fuse_qkv(*tensors, groups=model.num_query_groups or model.num_attention_heads)
        case "glu":
            return torch.cat(tensors)
        case "expert":  # row E of a tensor stacking all experts; gate_up_proj rows are [gate; up]
            return tensors[0][int(fields["E"])]
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def to_hf(rule: Rule, tensor: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
    """The canonical megatron tensor of `rule` -> its HF tensors, in rule.hf order."""
    match rule.kind:
        case "copy":
            return [tensor]
        case "vocab":
            return [tensor[: model.vocab_size]]
        case "qkv":
            return list(split_qkv(tensor, model.num_attention_heads,
                                  model.num_query_groups or model.num_attention_heads))
        case "glu":
            return list(tensor.chunk(2))
    raise ValueError(f"rule kind {rule.kind!r} cannot be exported")
