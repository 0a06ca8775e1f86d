"""Paged attention in torch, for megatron-core's dynamic inference engine where flash-attn is absent.

megatron-core's dynamic engine keeps the KV cache in fixed-size blocks and calls two flash-attn
kernels: `flash_attn_varlen_func` (prefill: packed queries of several requests) and
`flash_attn_with_kvcache` (decode: one query per request). These are vectorized torch versions
with the same signatures: gather each request's blocks, mask by length (causal, aligned to the
end of its keys), one scaled_dot_product_attention call for the whole batch.
"""

import torch
import torch.nn.functional as F


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, max_len: int) -> torch.Tensor:
    """cache (num_blocks, block_size, heads, d), block_table (B, nb) -> (B, heads, L, d) with only the
    blocks that hold the first max_len positions (L = those blocks' tokens)."""
    bs = cache.shape[1]
    used = block_table[:, : max(1, -(-max_len // bs))].clamp(min=0)  # -1 marks unused slots
    blocks = cache[used]  # (B, nb, block_size, heads, d)
    b, nb, _, h, d = blocks.shape
    return blocks.reshape(b, nb * bs, h, d).transpose(1, 2)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal=True, softmax_scale=None,
                            **_unused):
    """Decode: q (B, 1, heads, d) against each request's first cache_seqlens[b] cached keys."""
    max_len = int(cache_seqlens.max())
    k = _gather_blocks(k_cache, block_table, max_len)  # (B, groups, L, d)
    v = _gather_blocks(v_cache, block_table, max_len)
    b, groups, length, d = k.shape
    heads = q.shape[2]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    # The queries sharing a key/value head attend together: one batched matmul per step, no copies
    # of the keys per query head (grouped-query attention).
    qg = q.reshape(b, groups, heads // groups, d)  # heads are ordered group-major
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # (B, groups, heads/groups, L)
    valid = torch.arange(length, device=q.device)[None, :] < cache_seqlens.clamp(min=1)[:, None]  # (B, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v)  # (B, groups, heads/groups, dv)
    return out.reshape(b, 1, heads, -1)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=True, block_table=None, **_unused):
    """Prefill: packed queries q (T, heads, d) of B requests against their paged caches k, v."""
    q_lens = cu_seqlens_q.diff()
    k_lens = cu_seqlens_k.diff()
    n = int(cu_seqlens_q[-1])
    requests = torch.repeat_interleave(torch.arange(len(q_lens), device=q.device), q_lens)  # (n,)
    pos = torch.arange(n, device=q.device) - cu_seqlens_q[requests]  # position within the request's queries
    padded = q.new_zeros(len(q_lens), int(max_seqlen_q), *q.shape[1:])  # (B, max_q, heads, d)
    padded[requests, pos] = q[:n]
    keys = _gather_blocks(k, block_table, int(max_seqlen_k))  # (B, groups, L, d)
    values = _gather_blocks(v, block_table, int(max_seqlen_k))
    key_pos = torch.arange(keys.shape[2], device=q.device)[None, None, :]  # (1, 1, L)
    query_pos = (k_lens - q_lens)[:, None, None] + torch.arange(int(max_seqlen_q), device=q.device)[None, :, None]
    mask = (key_pos <= query_pos) & (key_pos < k_lens[:, None, None])  # (B, max_q, L)
    mask[..., 0] = True  # padding query rows: attend somewhere rather than to nothing (NaN)
    out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                         scale=softmax_scale, enable_gqa=keys.shape[1] != q.shape[1])
    result = torch.zeros_like(q)
    result[:n] = out.transpose(1, 2)[requests, pos]
    return result
