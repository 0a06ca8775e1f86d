"""Paged attention in torch, for megatron-core's dynamic inference engine where flash-attn is absent.

megatron-core's dynamic engine keeps the KV cache in fixed-size blocks and calls two flash-attn
kernels: `flash_attn_varlen_func` (prefill: packed queries of several requests) and
`flash_attn_with_kvcache` (decode: one query per request). These are vectorized torch versions
with the same signatures: gather each request's blocks in use (whole blocks; or as many keys as
the training forward's attention runs over, model_providers/attention.py ONE_PASS_KEYS), then one
scaled_dot_product_attention call for the whole batch, masked by length (causal, aligned to the
end of each request's keys).
"""

import torch
import torch.nn.functional as F

from model_providers.attention import fixed_keys


def _gather_kv(k_cache, v_cache, block_table, length):
    """The blocks holding each request's first `length` cached keys and values, as (B, heads, L, d)
    views, L = those blocks' tokens (mask positions >= the request's length). k_cache, v_cache:
    (num_blocks, block_size, heads, d). index_select copies whole blocks (4x faster on CPU than
    advanced indexing, which computes an offset per element)."""
    bs = k_cache.shape[1]
    blocks = max(1, -(-length // bs))
    used = block_table[:, :blocks].clamp(min=0)  # -1 marks unused slots
    if used.shape[1] < blocks:  # attention over more keys than the table holds (fixed_keys): masked
        used = F.pad(used, (0, blocks - used.shape[1]))
    b, nb = used.shape
    flat = used.flatten()
    return (x.index_select(0, flat).view(b, nb * bs, *x.shape[2:]).transpose(1, 2) for x in (k_cache, v_cache))


def _keys(k_cache, v_cache, block_table, needed: int, device):
    """Each request's cached keys and values over the whole blocks covering `needed` keys, or over
    exactly fixed_keys(device) keys where the training forward's attention runs over that many."""
    fixed = fixed_keys(device)
    length = fixed if needed <= fixed else needed
    keys, values = _gather_kv(k_cache, v_cache, block_table, length)
    if length != needed:
        keys, values = keys[:, :, :length], values[:, :, :length]
    return keys, values


# GEMM calls with fewer rows than this sum each dot product in another order (MKL, measured on
# x86: 1-3 rows differ from 4 or more, which all agree row for row).
MIN_GEMM_ROWS = 4


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal=True, softmax_scale=None,
                            **_unused):
    """Decode: q (B, 1, heads, d) against each request's first cache_seqlens[b] cached keys.

    The query heads sharing a key/value head are the rows of one scaled_dot_product_attention
    call on that head (padded to MIN_GEMM_ROWS rows): torch's CPU flash kernel then computes every
    head exactly as the training forward's causal attention computes that token, so that rollout
    and training logprobs agree bit for bit here. It reads the gathered keys in place (no
    transposed copies) and costs about half as much as explicit matmuls and softmax."""
    k, v = _keys(k_cache, v_cache, block_table, int(cache_seqlens.max()), q.device)  # (B, groups, L, d)
    b, groups, length, d = k.shape
    per_group = q.shape[2] // groups
    qg = q.reshape(b, groups, per_group, d)  # heads are ordered group-major
    if per_group < MIN_GEMM_ROWS:
        qg = torch.cat([qg, qg.new_zeros(b, groups, MIN_GEMM_ROWS - per_group, d)], dim=2)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=_decode_mask(cache_seqlens, length), scale=softmax_scale)
    return out[:, :, :per_group].reshape(b, 1, groups * per_group, -1)


_last_mask = (None, None, None)  # (cache_seqlens, inference mode, mask) of the last decode step


def _decode_mask(cache_seqlens, length):
    """(B, 1, 1, L) additive mask: 0 on each request's first cache_seqlens[b] keys, -inf after. The
    kernel would turn a boolean mask into this very tensor (the same arithmetic) on every call;
    made once per decode step (every layer asks again) it saves about 0.3 of SDPA's 2 ms a call on
    CPU at 64 requests."""
    global _last_mask
    seqlens, mode, mask = _last_mask
    inference = torch.is_inference_mode_enabled()
    if mask is None or mode != inference or mask.shape[-1] != length or not torch.equal(seqlens, cache_seqlens):
        valid = torch.arange(length, device=cache_seqlens.device)[None, :] < cache_seqlens.clamp(min=1)[:, None]
        mask = torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))[:, None, None, :]
        _last_mask = (cache_seqlens.clone(), inference, mask)
    return mask


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
    keys, values = _keys(k, v, block_table, int(max_seqlen_k), q.device)  # (B, groups, L, d)
    key_pos = torch.arange(keys.shape[2], device=q.device)[None, None, :]  # (1, 1, L)
    query_pos = (k_lens - q_lens)[:, None, None] + torch.arange(int(max_seqlen_q), device=q.device)[None, :, None]
    mask = (key_pos <= query_pos) & (key_pos < k_lens[:, None, None])  # (B, max_q, L)
    mask[..., 0] = True  # padding query rows: attend somewhere rather than to nothing (NaN)
    out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                         scale=softmax_scale, enable_gqa=keys.shape[1] != q.shape[1])
    result = q.new_zeros(*q.shape[:-1], values.shape[-1])  # values may have other channels than keys (MLA)
    result[:n] = out.transpose(1, 2)[requests, pos]
    return result
