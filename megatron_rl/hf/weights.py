"""Move weights between a (sharded) megatron model and Hugging Face tensors, one tensor at a time.

Each rank handles only the parameters it holds. A local name (`decoder.layers.0.mlp.experts.
local_experts.1.linear_fc1.weight` on pipeline stage 2, expert rank 1) is mapped to its canonical
name (global layer and expert numbers, local-spec module names) and to where its slice sits in the
canonical, unsharded tensor (`Placement`). The family's rules (model_providers/) do the rest.
"""

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, ModelConfig
from model_providers.mapping import Rule, rules_for, to_hf, to_megatron

# Transformer Engine fuses norms into the following linear layer; canonical names are the local spec's.
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")  # SequentialMLP
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TEGroupedMLP


def canonical_layer_suffix(suffix: str, expert_offset: int) -> str:
    """Within one layer: TE's fused norm names and local expert numbers -> canonical names."""
    if suffix in _TE_NORMS:
        return _TE_NORMS[suffix]
    m = _LOCAL_EXPERT.match(suffix)
    if m:
        return f"mlp.experts.{expert_offset + int(m.group(1))}.{m.group(2)}"
    m = _GROUPED_EXPERT.match(suffix)
    if m:
        return f"mlp.experts.{expert_offset + int(m.group(2))}.{m.group(1)}.weight"
    return suffix


@dataclass
class Placement:
    """Where a local tensor sits in its canonical tensor: a slice along `dim` (None: the whole
    tensor) of `size` equal parts, part `rank`. `parts`: the canonical tensor concatenates parts of
    these sizes along `dim` (a GLU's [gate; up], Mamba's [z | x | B | C | dt]), each split over the
    ranks, and a rank holds its share of each part in turn."""

    dim: int | None = None
    rank: int = 0
    size: int = 1
    group: object = None
    parts: tuple[int, ...] | None = None

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None or self.size == 1:
            return full
        if self.parts:
            return torch.cat([part.chunk(self.size, self.dim)[self.rank]
                              for part in full.split(list(self.parts), self.dim)], self.dim)
        return full.chunk(self.size, self.dim)[self.rank]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """All ranks of the group call this; every one gets the canonical tensor."""
        if self.dim is None or self.size == 1:
            return local
        shards = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(shards, local.contiguous(), group=self.group)
        if self.parts:
            local_sizes = [n // self.size for n in self.parts]
            pieces = [s.split(local_sizes, self.dim) for s in shards]
            return torch.cat([torch.cat([p[i] for p in pieces], self.dim) for i in range(len(self.parts))], self.dim)
        return torch.cat(shards, self.dim)


def _parts(name: str, tensor: torch.Tensor, model: ModelConfig, size: int) -> tuple[int, ...] | None:
    """The concatenated parts of a fused canonical tensor, or None."""
    if getattr(tensor, "partition_stride", 1) == 2:  # [gate; up]
        return (tensor.shape[tensor.partition_dim] * size // 2,) * 2
    if ".mixer.in_proj." in name or ".mixer.conv1d." in name:  # Mamba: [z |] x | B | C [| dt]
        inner = model.mamba_num_heads * model.mamba_head_dim
        bc = model.mamba_num_groups * model.mamba_state_dim
        return (inner, inner, bc, bc, model.mamba_num_heads) if ".in_proj." in name else (inner, bc, bc)
    return None


def local_tensors(chunk) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of one GPTModel chunk by local name (the base model's: LoRA
    adapters are not part of the HF checkpoint)."""
    from model_providers.builder import is_adapter, unwrap

    return {k: v for k, v in unwrap(chunk).state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state") and not is_adapter(k)}


def canonical(name: str, tensor: torch.Tensor, chunk, model: ModelConfig) -> tuple[str, Placement]:
    """A local tensor's canonical name and placement."""
    from megatron.core import parallel_state as ps

    from model_providers.builder import unwrap

    m = _LAYER.match(name)
    expert = False
    if m:
        layer = unwrap(chunk).decoder.layers[int(m.group(1))]
        num_local = model.num_experts // ps.get_expert_model_parallel_world_size() if model.num_experts else 0
        suffix = canonical_layer_suffix(m.group(2), ps.get_expert_model_parallel_rank() * num_local)
        expert = suffix.startswith("mlp.experts.")
        name = f"decoder.layers.{layer.layer_number - 1}.{suffix}"
    elif name == "output_layer.weight" and model.tie_embeddings:
        name = "embedding.word_embeddings.weight"  # the last stage's copy of a tied embedding
    if not getattr(tensor, "tensor_model_parallel", False):
        return name, Placement()
    if expert:
        rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        group = ps.get_expert_tensor_parallel_group()
    else:
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        group = ps.get_tensor_model_parallel_group()
    # megatron marks Mamba's convolution and per-head parameters tensor-parallel without a partition_dim: dim 0
    dim = getattr(tensor, "partition_dim", 0)
    return name, Placement(dim=dim, rank=rank, size=size, group=group, parts=_parts(name, tensor, model, size))


def is_writer(canonical_name: str) -> bool:
    """Exactly one rank writes each canonical tensor: TP rank 0 of the first data-parallel replica."""
    from megatron.core import parallel_state as ps

    if ".mlp.experts." in canonical_name:
        return ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


def _each_tensor(model_chunks: list, desc: str):
    """(chunk, local name, tensor) of this rank, with a progress bar on rank 0."""
    from tqdm import tqdm

    items = [(chunk, name, t) for chunk in model_chunks for name, t in local_tensors(chunk).items()]
    # disable=None: no bar when stderr is not a terminal (a log file would keep every redraw)
    return tqdm(items, desc=desc, unit="tensor", disable=True if dist.get_rank() != 0 else None, leave=False)


def load_hf_weights(model_chunks: list, model: ModelConfig, rules: list[Rule], checkpoint, skipped=None,
                    fresh: set[str] = frozenset()):
    """Copy an HF checkpoint's tensors into this rank's part of the model. Every HF tensor must be
    used by some rank (or `skipped` must say why not), and every model tensor but those named in
    `fresh` filled, else a ConfigError says which."""
    available = checkpoint.names()
    used, error = set(), None
    try:
        for chunk, local_name, dst in _each_tensor(model_chunks, "import"):
            if local_name not in fresh:
                used.update(_load_one(chunk, local_name, dst, model, rules, checkpoint, available))
    except ConfigError as e:
        error = str(e)  # reported once every rank is done, so no rank waits forever for another
    _check_all_used(available, used, error, model, skipped)


def _load_one(chunk, local_name: str, dst: torch.Tensor, model: ModelConfig, rules, checkpoint, available) -> list[str]:
    """Fill one local tensor from the HF checkpoint; returns the HF names it used."""
    name, place = canonical(local_name, dst, chunk, model)
    candidates = rules_for(rules, name)
    if not candidates:
        raise ConfigError(f"the {model.family} converter has no rule for megatron tensor {name!r}.")
    # The first rule whose HF tensors are all present (several HF layouts may be accepted).
    rule, fields = next(((r, f) for r, f in candidates if set(r.hf_names(f)) <= available), candidates[0])
    hf_names = rule.hf_names(fields)
    try:
        full = to_megatron(rule, [checkpoint.get(n) for n in hf_names], model, fields)
        local = place.slice(full)
    except (RuntimeError, ValueError, IndexError) as e:
        raise ConfigError(f"HF tensor(s) {', '.join(hf_names)} do not fit megatron tensor {name!r} "
                          f"({e}); config.json does not match the weights.") from None
    if local.shape != dst.shape:
        raise ConfigError(f"HF tensor(s) {', '.join(hf_names)} give megatron tensor {name!r} shape "
                          f"{tuple(local.shape)}, but config.json implies {tuple(dst.shape)}: the config does "
                          f"not match the weights.")
    with torch.no_grad():
        dst.copy_(local)
    return hf_names


def _check_all_used(available: set, used: set, error: str | None, model: ModelConfig, skipped):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(used), error))
    errors = [e for _, e in everyone if e]
    if errors:
        raise ConfigError(errors[0])
    unused = available - set().union(*(set(u) for u, _ in everyone))
    reasons = {}
    for name in sorted(unused):
        why = skipped(name, model) if skipped else None
        if why is None:
            raise ConfigError(f"the HF checkpoint has tensors the model does not use (e.g. {name!r}, "
                              f"{len(unused)} in all): config.json does not match the weights.")
        reasons.setdefault(why, []).append(name)
    if dist.get_rank() == 0:
        for why, names in reasons.items():
            print(f"note: skipped {len(names)} HF tensors ({names[0]}, ...): {why}.", flush=True)


def export_hf_weights(model_chunks: list, model: ModelConfig, rules: list[Rule], writer, dtype: torch.dtype):
    """Hand this rank's share of HF tensors to `writer`; all ranks take part in the TP gathers."""
    export_rules = [r for r in rules if r.kind != "expert"]
    for chunk, local_name, tensor in _each_tensor(model_chunks, "export"):
        if local_name == "output_layer.weight" and model.tie_embeddings:
            continue  # the embedding is written from the first stage
        name, place = canonical(local_name, tensor, chunk, model)
        full = place.gather(tensor.detach())
        if not is_writer(name):
            continue
        candidates = rules_for(export_rules, name)
        if not candidates:
            raise ConfigError(f"the {model.family} converter has no rule for megatron tensor {name!r}.")
        rule, fields = candidates[0]
        for hf_name, t in zip(rule.hf_names(fields), to_hf(rule, full, model)):
            writer.add(hf_name, t, dtype)
