"""LoRA: low-rank adapters beside megatron's linear layers (lora.rank > 0).

Each targeted layer (a ColumnParallelLinear or RowParallelLinear of the local spec) gets a sibling module
`<name>_lora` holding its adapters, and a forward hook that adds (alpha / rank) * B(A(x)) to the layer's
output; megatron's modules are neither forked nor replaced, and the base weights keep their names.

Fused layers get one adapter per projection: megatron's linear_qkv (per query group: its q heads, then k,
then v) has a q, a k and a v adapter, a gated linear_fc1 ([gate; up]) a gate and an up adapter, so the
adapters are exactly PEFT's per-projection ones (q_proj, k_proj, v_proj, gate_proj, up_proj) both ways.

A and B are megatron linear layers themselves, so their GEMMs take the same path as the base's (the CPU
GEMM patch, the bitwise rollout/training agreement) and they are split as the base is:
- column-parallel base: A (in -> r) split over r and gathered (with sequence parallelism it gathers the
  sequence-sharded input as the base does), B (r -> out) split over out like the base's output;
- row-parallel base: A (in -> r) split over in like the base's input and all-reduced, B (r -> out) split
  over out and gathered, then scattered back to the sequence-parallel region when the base's output is.
Every gradient is then megatron's own collective's; no adapter parameter sees a partial sum.

A starts as PEFT's (Kaiming-uniform over the full fan-in), drawn from a generator seeded by the tensor's
canonical name, so the model is the same at every TP/PP layout; B starts at zero.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import zlib
from contextlib import contextmanager

import torch

from megatron_rl.config import ConfigError, LoRAConfig
from model_providers.builder import ADAPTERS, is_adapter, unwrap


class Adapters(torch.nn.Module):
    """The adapters of one linear layer: per slice (projection) an A and a B."""

    def __init__(self, base, slices: dict[str, int], column: bool, cfg: LoRAConfig, tconfig, layout=None):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.scale, self.column, self.layout, self.enabled = cfg.alpha / cfg.rank, column, layout, True
        self.sequence_parallel = base.sequence_parallel
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout else torch.nn.Identity()
        no_sp = copy.copy(tconfig)
        no_sp.sequence_parallel = False  # B's input is the whole sequence
        keep = lambda w: None  # noqa: E731 -- values come from init_adapters (layout-independent)
        if column:
            self.a = torch.nn.ModuleDict({s: ColumnParallelLinear(
                base.input_size, cfg.rank, config=tconfig, init_method=keep, bias=False, gather_output=True)
                for s in slices})
            self.b = torch.nn.ModuleDict({s: ColumnParallelLinear(
                cfg.rank, n, config=no_sp, init_method=keep, bias=False, gather_output=False)
                for s, n in slices.items()})
        else:
            self.a = torch.nn.ModuleDict({s: RowParallelLinear(
                base.input_size, cfg.rank, config=no_sp, init_method=keep, bias=False, input_is_parallel=True,
                skip_bias_add=True) for s in slices})
            self.b = torch.nn.ModuleDict({s: ColumnParallelLinear(
                cfg.rank, n, config=no_sp, init_method=keep, bias=False, gather_output=True)
                for s, n in slices.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        x = self.dropout(x)
        outs = [self.b[s](self.a[s](x)[0])[0] for s in self.a]
        if self.layout is not None:
            out = self.layout(outs)
        else:
            out = outs[0]
        if not self.column and self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out)
        return out * self.scale

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The A and B layers' own (TP-sharded) entries, for megatron's distributed checkpoints."""
        out = {}
        for side in ("a", "b"):
            for s, linear in getattr(self, side).items():
                out.update(linear.sharded_state_dict(f"{prefix}{side}.{s}.", sharded_offsets, metadata))
        return out

    def delta(self) -> torch.Tensor:
        """(alpha / rank) * B A in the base weight's local layout (its rows interleaved as its output is):
        a column-parallel base needs all of A's rank, a row-parallel one all of B's outputs."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather_last

        def whole(w):  # the TP shards of a (rows, cols) weight split over rows, all rows on every rank
            return gather_last(w.t().contiguous()).t()

        deltas = [self.b[s].weight @ whole(self.a[s].weight) if self.column else whole(self.b[s].weight) @ self.a[s].weight
                  for s in self.a]
        if self.layout is not None:
            return self.layout([d.t() for d in deltas]).t() * self.scale
        return deltas[0] * self.scale


def _interleave_qkv(groups_local: int):
    """q, k, v outputs (..., groups * heads_per_group * d), (..., groups * d) x 2 -> megatron's fused layout."""
    def layout(outs):
        q, k, v = outs
        lead = q.shape[:-1]
        parts = [t.reshape(*lead, groups_local, -1) for t in (q, k, v)]
        return torch.cat(parts, dim=-1).reshape(*lead, -1)
    return layout


def _concat(outs):
    return torch.cat(outs, dim=-1)


def _hook(adapters: Adapters):
    def add(module, args, output):
        if not adapters.enabled:
            return output
        out, bias = output
        return out + adapters(args[0]), bias
    return add


def _matches(name: str, targets) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatch(name, t) if any(c in t for c in "*?[") else t == last for t in targets)


def _slices(name: str, base, tconfig, tp: int) -> tuple[dict[str, int], object]:
    """Per-projection output sizes of a fused layer (whole, not per rank) and how their outputs interleave."""
    if name.endswith("self_attention.linear_qkv"):
        d, heads, groups = tconfig.kv_channels, tconfig.num_attention_heads, tconfig.num_query_groups
        if base.output_size == (heads + 2 * groups) * d:
            return {"q": heads * d, "k": groups * d, "v": groups * d}, _interleave_qkv(groups // tp)
    if name.endswith("linear_fc1") and tconfig.gated_linear_unit:
        half = base.output_size // 2
        return {"gate": half, "up": half}, _concat
    return {"w": base.output_size}, None


def targets(chunk, cfg: LoRAConfig) -> list[tuple[str, object, object]]:
    """(name, module, parent) of every linear layer lora.targets names in one model chunk (MoE experts
    included: add_adapters leaves them out)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    found = []
    for parent_name, parent in chunk.named_modules():
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear)) and not is_adapter(name + ".") \
                    and _matches(name, cfg.targets):
                found.append((name, child, parent))
    return found


def add_adapters(chunks: list, cfg: LoRAConfig, tconfig, model_cfg, seed: int, init: bool = True):
    """Give every targeted layer of these chunks its adapters and freeze everything else. Collective over
    the world: a target that matches no layer of the whole model is refused in one sentence."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear

    te = [n for chunk in chunks for n, m in chunk.named_modules() if type(m).__name__.startswith("TELayerNorm")]
    if te:
        raise ConfigError("lora.rank > 0 needs megatron's local layer spec: Transformer Engine's fused norm-linear "
                          "layers hide the normalized input from an adapter; run without Transformer Engine.")
    tp = ps.get_tensor_model_parallel_world_size()
    counts = torch.zeros(len(cfg.targets), dtype=torch.float64, device="cpu")  # also under the planner's meta device
    for chunk in chunks:
        for name, base, parent in targets(chunk, cfg):
            counts += torch.tensor([float(_matches(name, [t])) for t in cfg.targets], dtype=torch.float64, device="cpu")
            if ".experts." in name:  # MoE experts keep no adapters (linear_fc1 means the dense MLPs' ones)
                if any("experts" in t and _matches(name, [t]) for t in cfg.targets):
                    raise ConfigError(f"lora.targets names MoE expert layers ({name}): adapters on experts are not "
                                      f"supported yet; target the attention and dense MLP layers.")
                continue
            column = isinstance(base, ColumnParallelLinear)  # its A splits the rank over TP (checked in Config)
            slices, layout = _slices(name, base, tconfig, tp)
            adapters = Adapters(base, slices, column, cfg, tconfig, layout)
            parent.add_module(name.rsplit('.', 1)[-1] + ADAPTERS, adapters)
            base.register_forward_hook(_hook(adapters))
    if dist.is_initialized():
        dist.all_reduce(counts)
    unmatched = [t for t, c in zip(cfg.targets, counts.tolist()) if not c]
    if unmatched:
        raise ConfigError(f"lora.targets {', '.join(unmatched)} match no linear layer of this model; name layers as "
                          f"linear_qkv, linear_proj, linear_fc1, linear_fc2 (or a glob over full names such as "
                          f"*.layers.0.*.linear_qkv).")
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            p.requires_grad_(is_adapter(name))
    if init:
        init_adapters(chunks, model_cfg, seed)


def adapter_modules(chunks: list) -> list[Adapters]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, Adapters)]


def init_adapters(chunks: list, model_cfg, seed: int):
    """A: Kaiming-uniform over the full fan-in (PEFT's), drawn per canonical tensor name; B: zero."""
    from megatron_rl.hf.weights import canonical

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not is_adapter(name):
                continue
            canonical_name, place = canonical(name, p, chunk, model_cfg)
            with torch.no_grad():
                if f"{ADAPTERS}.b." in name:
                    p.zero_()
                    continue
                shape = list(p.shape)
                if place.dim is not None:
                    shape[place.dim] *= place.size
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(canonical_name.encode()))
                full = torch.empty(shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
                p.copy_(place.slice(full).to(p.dtype))


@contextmanager
def adapters_off(chunks: list):
    """The model without its adapters (the reference policy of a LoRA run); a no-op without adapters."""
    mods = adapter_modules(chunks)
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


def _per_shard(chunks: list, model_cfg, value) -> dict[tuple[str, int], object]:
    """value(name, parameter) of every shard of every canonical tensor, gathered from all ranks and keyed by
    (canonical name, shard): the copies on other data- and context-parallel ranks collapse into one."""
    import torch.distributed as dist

    from megatron_rl.hf.weights import canonical

    mine = {}
    for chunk in chunks:
        for name, p in unwrap(chunk).named_parameters():
            full, place = canonical(name, p, chunk, model_cfg)
            mine[(full, place.rank if place.dim is not None else 0)] = value(name, p)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def parameter_counts(chunks: list, model_cfg) -> tuple[int, int]:
    """(trainable, all) parameters of the whole model: every tensor once, whatever the layout."""
    shards = _per_shard(chunks, model_cfg, lambda _, p: (p.numel(), p.requires_grad)).values()
    return sum(n for n, trained in shards if trained), sum(n for n, _ in shards)


def merge(chunks: list):
    """Fold every adapter into its base weight: W += (alpha / rank) B A (the adapters stay as they are)."""
    found = deltas(chunks)
    with torch.no_grad():
        for chunk in chunks:
            for _, base, _ in list(_based(chunk)):
                base.weight.add_(found[id(base.weight)])


def deltas(chunks: list) -> dict[int, torch.Tensor]:
    """(alpha / rank) B A of every adapted layer, by the id of its base weight (a collective over tensor-
    parallel ranks): what merge would add, leaving the model as it is."""
    with torch.no_grad():
        return {id(base.weight): getattr(parent, name + ADAPTERS).delta().to(base.weight.dtype)
                for chunk in chunks for name, base, parent in list(_based(chunk))}


def merge_and_reset(chunks: list, model_cfg, seed: int):
    """Merge the adapters and start them afresh: a stacked stage (LoRA-SFT, then LoRA-GRPO) trains new
    adapters on base plus the earlier ones."""
    merge(chunks)
    init_adapters(chunks, model_cfg, seed)


def _based(chunk):
    """(last name, base layer, parent) of every layer that has adapters."""
    for parent in chunk.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, Adapters):
                base_name = child_name.removesuffix(ADAPTERS)
                yield base_name, getattr(parent, base_name), parent


def base_checksum(chunks: list, model_cfg) -> dict[str, list[float]]:
    """Per canonical tensor of the base (every parameter but the adapters): its sum and sum of squares in
    float64, over all ranks; the same (to rounding) at any layout."""
    def moments(name, p):
        x = p.detach().double()
        return None if is_adapter(name) else [x.sum().item(), (x * x).sum().item()]

    out = {}
    for (name, _), pair in sorted(_per_shard(chunks, model_cfg, moments).items()):
        if pair is not None:
            total = out.setdefault(name, [0.0, 0.0])
            total[0], total[1] = total[0] + pair[0], total[1] + pair[1]
    return out


def check_base(checksum: dict, saved: dict, where) -> None:
    """Refuse adapters whose recorded base is not the one loaded."""
    theirs = saved["checksum"]
    differ = [n for n in sorted(set(checksum) | set(theirs))
              if n not in checksum or n not in theirs
              or not all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(checksum[n], theirs[n]))]
    if differ:
        raise ConfigError(f"the LoRA adapters of {str(where)!r} were trained on another base than {saved['path']!r} "
                          f"holds now ({differ[0]} differs): restore that base, or start the adapters afresh.")
