"""Sequence packing: the samples of a microbatch in one row of real tokens (megatron's THD layout).

Unpacked, every sample is padded to data.seq_length and the model computes the padding too. Packed,
a microbatch of b samples (rows of a (b, S) batch, each left-aligned, then padding) is fed as one
row of T tokens: each sample's first L_i tokens, L_i its length (rounded up to `multiple`: context
parallelism splits each sample), one after another, then filler up to a multiple of `total_multiple`
(or to a fixed `total`: pipeline stages exchange fixed shapes). cu_seqlens tell attention where each
sample starts, so none sees another, and rotary embeddings restart their positions per sample. The model's output at the packed positions is
put back into the samples' (b, W) grid (W: the longest L_i, at most S), so loss functions see the
unpacked layout and every per-sequence quantity stays per sequence.

Which samples share a microbatch is chosen by first-fit decreasing on their padded lengths under a
token budget (data.max_tokens_per_microbatch); a unit of several rows (a DPO pair) stays together.
"""

import torch


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fed_lengths(loss_mask: torch.Tensor) -> torch.Tensor:
    """Tokens each row feeds the model, (...,) from its (..., S) loss mask: through its last position
    that has a loss (what follows is padding; at least 1)."""
    s = loss_mask.shape[-1]
    last = torch.where(loss_mask > 0, torch.arange(1, s + 1), 0).amax(dim=-1)
    return last.clamp(min=1)


def groups(unit_lengths: list[int], budget: int) -> list[list[int]]:
    """Units (by index) into groups of at most `budget` tokens, first-fit decreasing; each group's
    units in index order. A unit longer than the budget is an error the caller prevents."""
    order = sorted(range(len(unit_lengths)), key=lambda i: (-unit_lengths[i], i))
    bins, loads = [], []
    for i in order:
        for b, load in enumerate(loads):
            if load + unit_lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += unit_lengths[i]
                break
        else:
            bins.append([i])
            loads.append(unit_lengths[i])
    return [sorted(b) for b in bins]


def split_to(group_list: list[list[int]], count: int) -> list[list[int]]:
    """The groups split (largest first, in halves) until there are `count` of them: data-parallel
    ranks whose microbatches meet in a collective (expert parallelism) must run as many."""
    out = [list(g) for g in group_list]
    while len(out) < count:
        largest = max(range(len(out)), key=lambda i: len(out[i]))
        g = out[largest]
        if len(g) < 2:
            raise ValueError(f"cannot make {count} microbatches of {sum(map(len, out))} samples")
        out[largest:largest + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return out


def pack(mb: dict[str, torch.Tensor], multiple: int, total_multiple: int = 1, total: int = 0) -> dict[str, torch.Tensor]:
    """The microbatch `mb` (rows (b, S, ...) per token, (b, ...) per row) with its per-token tensors cut
    to the grid width W and the packing added: pack_cu (segments' start offsets and the end, int32),
    pack_pos (K,) positions in the packed row and pack_index (K,) the same tokens' flat index in the
    (b, W) grid."""
    seq = mb["tokens"].shape[1]
    lengths = [round_up(int(n), multiple) for n in fed_lengths(mb["loss_mask"])]
    width = min(max(lengths), seq)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    end = total or round_up(starts[-1], total_multiple)
    if end < starts[-1]:
        raise ValueError(f"{starts[-1]} packed tokens exceed the fixed pack length {end}")
    if end > starts[-1]:
        starts.append(end)  # filler: a segment of its own, seen by no sample
    pos, index = [], []
    for i, n in enumerate(lengths):
        k = min(n, width)
        pos.append(torch.arange(starts[i], starts[i] + k))
        index.append(torch.arange(i * width, i * width + k))
    out = {k: v[:, :width] if v.dim() >= 2 and v.shape[1] == seq else v for k, v in mb.items()}
    out.update(pack_cu=torch.tensor(starts, dtype=torch.int32), pack_pos=torch.cat(pos), pack_index=torch.cat(index))
    return out


def unit_groups(batch: dict[str, torch.Tensor], budget: int, multiple: int) -> list[list[int]]:
    """Which units of `batch` (along dim 0: rows, or (N, 2, S) pairs) share a microbatch under a
    token budget (groups)."""
    rows = fed_lengths(batch["loss_mask"]).tolist()
    return groups([sum(round_up(n, multiple) for n in (r if isinstance(r, list) else [r])) for r in rows], budget)


def packed_microbatches(batch: dict[str, torch.Tensor], chosen: list[list[int]], multiple: int,
                        total_multiple: int = 1, total: int = 0, flatten=None) -> list[dict[str, torch.Tensor]]:
    """One packed microbatch (pack) per group of units in `chosen`. flatten: applied to each
    microbatch before packing (pairs -> rows)."""
    out = []
    for g in chosen:
        idx = torch.tensor(g)
        mb = {k: v[idx] for k, v in batch.items()}
        out.append(pack(flatten(mb) if flatten else mb, multiple, total_multiple, total))
    return out


def packed_row(x: torch.Tensor, mb: dict[str, torch.Tensor], fill=0) -> torch.Tensor:
    """A per-token tensor of the grid (b, W, ...) in packed order, (1, T, ...); filler is `fill`."""
    out = x.new_full((int(mb["pack_cu"][-1]), *x.shape[2:]), fill)
    out[mb["pack_pos"]] = x.flatten(0, 1)[mb["pack_index"]]
    return out[None]
