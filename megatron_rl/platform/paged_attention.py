"""Paged attention in torch, for megatron-core's dynamic inference engine where flash-attn is absent.

megatron-core's dynamic engine keeps the KV cache in fixed-size blocks and calls two flash-attn
kernels: `flash_attn_varlen_func` (prefill: packed queries of several requests) and
`flash_attn_with_kvcache` (decode: one query per request). These are vectorized torch versions
with the same signatures: gather each request's blocks, mask by length (causal, aligned to the
end of its keys), one scaled_dot_product_attention call for the whole batch.
"""

import torch
import torch.nn.functional as F


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache (num_blocks, block_size, heads, d), block_table (B, nb) -> (B, heads, nb * block_size, d)."""
    blocks = cache[block_table.clamp(min=0)]  # (B, nb, block_size, heads, d); -1 marks unused slots
    b, nb, bs, h, d = blocks.shape
    return blocks.reshape(b, nb * bs, h, d).transpose(1, 2)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal=True, softmax_scale=None,
                            **_unused):
    """Decode: q (B, 1, heads, d) against each request's first cache_seqlens[b] cached keys."""
    k = _gather_blocks(k_cache, block_table)  # (B, groups, L, d)
    v = _gather_blocks(v_cache, block_table)
    length = cache_seqlens.clamp(min=1)  # padding requests (length 0) attend to slot 0, not to nothing
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < length[:, None]  # (B, L)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=softmax_scale, enable_gqa=k.shape[1] != q.shape[2])
    return out.transpose(1, 2)  # (B, 1, heads, d)


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
    keys = _gather_blocks(k, block_table)  # (B, groups, L, d)
    values = _gather_blocks(v, block_table)
    key_pos = torch.arange(keys.shape[2], device=q.device)[None, None, :]  # (1, 1, L)
    query_pos = (k_lens - q_lens)[:, None, None] + torch.arange(int(max_seqlen_q), device=q.device)[None, :, None]
    mask = (key_pos <= query_pos) & (key_pos < k_lens[:, None, None])  # (B, max_q, L)
    mask[..., 0] = True  # padding query rows: attend somewhere rather than to nothing (NaN)
    out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                         scale=softmax_scale, enable_gqa=keys.shape[1] != q.shape[1])
    result = torch.zeros_like(q)
    result[:n] = out.transpose(1, 2)[requests, pos]
    return result
