"""Per-token quantities from vocab-parallel logits (each TP rank holds a slice of the vocabulary)."""

import torch

from megatron_rl.training import chunked
from megatron_rl.training.chunked import ChunkedLogits


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of padding entries (ids >= vocab_size) to -inf on the TP rank that holds them."""
    if isinstance(logits, ChunkedLogits):
        return logits.masked(vocab_size)
    pad = chunked.padding_start(vocab_size, logits.shape[-1])
    if pad is None:
        return logits
    logits = logits.clone()
    logits[..., pad:] = float("-inf")
    return logits


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """log p(labels) from vocab-parallel logits (B, S, V/tp); differentiable. Returns (B, S) fp32.
    threshold (B, S): a top-p / top-k sampler's kept set replayed: p is the distribution over the logits
    at or above it (and the label), renormalized; the rest get no gradient (-inf: the full distribution).

    Without a threshold, overwrites fp32 `logits` (megatron's cross entropy works in place to save
    memory): compute anything else from the logits before calling this.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if isinstance(logits, ChunkedLogits):
        return chunked.token_logprobs(logits, labels, threshold)
    if threshold is not None:
        logits = logits.float().masked_fill(chunked.outside_kept(logits, labels[..., None], threshold), float("-inf"))
    return -vocab_parallel_cross_entropy(logits.float(), labels)


@torch.no_grad()
def kept_size(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """How many entries of the whole vocabulary are at or above threshold (B, S), from vocab-parallel
    logits (B, S, V/tp) whose padding entries are -inf: (B, S) fp32."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if isinstance(logits, ChunkedLogits):
        return chunked.by_chunk(kept_size, logits, threshold)
    count = (logits.float() >= threshold[..., None]).sum(dim=-1).float()
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(count, group=ps.get_tensor_model_parallel_group())
    return count


@torch.no_grad()
def argmax_equals(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Whether labels are the argmax of vocab-parallel logits (B, S, V/tp): (B, S) bool.

    Ties count as a match only when the label holds the max, like greedy decoding's first-max.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if isinstance(logits, ChunkedLogits):
        return chunked.by_chunk(argmax_equals, logits, labels)
    if ps.get_tensor_model_parallel_world_size() == 1:
        return logits.argmax(dim=-1) == labels
    full = gather_from_tensor_model_parallel_region(logits.float())
    return full.argmax(dim=-1) == labels


@torch.no_grad()
def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution from vocab-parallel logits (B, S, V/tp): (B, S) fp32.

    Padding entries must already be -inf (mask_padded_vocab); they contribute nothing.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if isinstance(logits, ChunkedLogits):
        return chunked.by_chunk(entropy, logits)
    logits = logits.float()
    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    top = logits.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top[..., None]
    p_unnorm = shifted.exp()
    z = p_unnorm.sum(dim=-1)
    weighted = (p_unnorm * shifted.masked_fill(torch.isinf(shifted), 0.0)).sum(dim=-1)
    if tp > 1:
        dist.all_reduce(z, group=group)
        dist.all_reduce(weighted, group=group)
    return z.log() - weighted / z  # H = log Z - E[shifted logit]


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From vocab-parallel logits (B, S, V/tp), differentiably and in fp32: the log-probs of the full
    vocabulary at `ids` (B, S, k), and sum_v p_v log p_v (B, S). Padding entries must be -inf."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    if isinstance(logits, ChunkedLogits):
        return chunked.logprobs_at(logits, ids)
    logits = logits.float()
    tp, shard = ps.get_tensor_model_parallel_world_size(), logits.shape[-1]
    top = logits.detach().max(dim=-1).values
    if tp > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - top[..., None]
    e = shifted.exp()
    z = tp_sum(e.sum(dim=-1))
    local = ids - ps.get_tensor_model_parallel_rank() * shard
    mine = (local >= 0) & (local < shard)
    picked = tp_sum(torch.where(mine, shifted.gather(-1, local.clamp(0, shard - 1)), 0.0))
    neg_entropy = tp_sum((e * shifted.masked_fill(e == 0, 0.0)).sum(dim=-1)) / z - z.log()
    return picked - z.log()[..., None], neg_entropy


def _by_value_then_id(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values, ties to the lowest id, in that order."""
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    best = values.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return values.gather(-1, best), ids.gather(-1, best)


@torch.no_grad()
def vocab_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of vocab-parallel logits (B, S, V/tp) over the whole vocabulary, ties going to the
    lowest id: (values fp32, ids), each (B, S, k) and the same on every TP rank. Each rank takes its
    shard's k largest, the ranks gather them, and the global k largest are taken from those."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if isinstance(logits, ChunkedLogits):
        parts = [vocab_topk(logits.logits(rows), k) for rows in logits.rows()]
        return tuple(torch.cat(t).view(*logits.hidden.shape[:-1], k) for t in zip(*parts))
    logits = logits.float()
    tp, shard = ps.get_tensor_model_parallel_world_size(), logits.shape[-1]
    values, ids = logits.topk(min(k, shard), dim=-1)
    # torch.topk does not say which of equal values it keeps: where it left out one equal to its last,
    # that position's row is sorted instead (stably: the lower id first)
    last = values[..., -1:]
    left_out = (logits == last).sum(dim=-1) > (values == last).sum(dim=-1)
    if left_out.any():
        rows = left_out.nonzero(as_tuple=True)
        ordered = logits[rows].sort(dim=-1, descending=True, stable=True)
        values[rows], ids[rows] = ordered.values[..., : values.shape[-1]], ordered.indices[..., : values.shape[-1]]
    ids = ids + ps.get_tensor_model_parallel_rank() * shard
    if tp > 1:
        group = ps.get_tensor_model_parallel_group()
        all_values, all_ids = [torch.empty_like(values) for _ in range(tp)], [torch.empty_like(ids) for _ in range(tp)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_ids, ids.contiguous(), group=group)
        values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)
    return _by_value_then_id(values, ids, k)
