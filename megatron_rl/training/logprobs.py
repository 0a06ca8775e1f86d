"""Per-token quantities from vocab-parallel logits (each TP rank holds a slice of the vocabulary)."""

import torch


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of padding entries (ids >= vocab_size) to -inf on the TP rank that holds them."""
    from megatron.core import parallel_state as ps

    shard = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    first_pad = vocab_size - start
    if first_pad >= shard:
        return logits
    logits = logits.clone()
    logits[..., max(first_pad, 0):] = float("-inf")
    return logits


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) from vocab-parallel logits (B, S, V/tp); differentiable. Returns (B, S) fp32.

    Overwrites fp32 `logits` (megatron's cross entropy works in place to save memory): compute
    anything else from the logits before calling this.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float(), labels)


@torch.no_grad()
def argmax_equals(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Whether labels are the argmax of vocab-parallel logits (B, S, V/tp): (B, S) bool.

    Ties count as a match only when the label holds the max, like greedy decoding's first-max.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

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
