"""Paged attention in torch, for megatron-core's dynamic inference engine where flash-attn is absent.

megatron-core's dynamic engine keeps the KV cache in fixed-size blocks and calls two flash-attn
kernels: `flash_attn_varlen_func` (prefill: packed queries of several requests) and
`flash_attn_with_kvcache` (decode: one query per request). These are vectorized torch versions
with the same signatures: gather each request's blocks in use (whole blocks, keys and values in one
index op), then one scaled_dot_product_attention
call (prefill) or two batched matmuls (decode) for the whole batch, masked by length (causal,
aligned to the end of each request's keys).
"""

import torch
import torch.nn.functional as F


def _gather_kv(k_cache, v_cache, block_table, length):
    """The blocks holding each request's first `length` cached keys and values, as (B, heads, L, d)
    views, L = those blocks' tokens (mask positions >= the request's length). k_cache, v_cache:
    (num_blocks, block_size, heads, d). megatron keeps both in one buffer [2, layers, ...]: then
    a single index op gathers both."""
    bs = k_cache.shape[1]
    used = block_table[:, : max(1, -(-length // bs))].clamp(min=0)  # -1 marks unused slots
    both = _stacked(k_cache, v_cache)
    k, v = both[:, used] if both is not None else (k_cache[used], v_cache[used])  # (B, nb, block_size, heads, d)
    b, nb = used.shape
    return (x.reshape(b, nb * bs, *x.shape[3:]).transpose(1, 2) for x in (k, v))


def _stacked(k, v):
    """k and v as one (2, ...) view when v is k shifted by a fixed offset in the same storage."""
    if (k.shape != v.shape or k.stride() != v.stride()
            or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()):
        return None
    offset = v.storage_offset() - k.storage_offset()
    if offset <= 0:
        return None
    return k.as_strided((2,) + tuple(k.shape), (offset,) + tuple(k.stride()), k.storage_offset())


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal=True, softmax_scale=None,
                            **_unused):
    """Decode: q (B, 1, heads, d) against each request's first cache_seqlens[b] cached keys."""
    k, v = _gather_kv(k_cache, v_cache, block_table, int(cache_seqlens.max()))  # (B, groups, L, d)
    b, groups, length, d = k.shape
    heads = q.shape[2]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    # The queries sharing a key/value head attend together: one batched matmul per step, no copies
    # of the keys per query head (grouped-query attention). SDPA would save the two copies the
    # matmuls make of the transposed keys and values (about 1 ms of 60 per step), but its
    # different rounding doubled the rollout/training logprob mismatch (to about 1e-5).
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
    keys, values = _gather_kv(k, v, block_table, int(max_seqlen_k))  # (B, groups, L, d)
    key_pos = torch.arange(keys.shape[2], device=q.device)[None, None, :]  # (1, 1, L)
    query_pos = (k_lens - q_lens)[:, None, None] + torch.arange(int(max_seqlen_q), device=q.device)[None, :, None]
    mask = (key_pos <= query_pos) & (key_pos < k_lens[:, None, None])  # (B, max_q, L)
    mask[..., 0] = True  # padding query rows: attend somewhere rather than to nothing (NaN)
    out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                         scale=softmax_scale, enable_gqa=keys.shape[1] != q.shape[1])
    result = torch.zeros_like(q)
    result[:n] = out.transpose(1, 2)[requests, pos]
    return result
