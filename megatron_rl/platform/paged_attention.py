"""Paged attention in torch, for megatron-core's dynamic inference engine where flash-attn is absent.

megatron-core's dynamic engine keeps the KV cache in fixed-size blocks and calls two flash-attn
kernels: `flash_attn_varlen_func` (prefill: packed queries of several requests) and
`flash_attn_with_kvcache` (decode: one query per request). These are vectorized torch versions
with the same signatures: gather each request's blocks in use (whole blocks; or as many keys as
the training forward's attention runs over, megatron_rl/platform/attention.py ONE_PASS_KEYS), then one
scaled_dot_product_attention call for the whole batch, masked by length (causal, aligned to the
end of each request's keys).
"""

import torch
import torch.nn.functional as F

from megatron_rl.platform.attention import fixed_keys, packed_positions


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


class _Step:
    """What the engine knows on the host before a step's forward (rollout/engine.py's context sets it
    in initialize_attention_state, outside the forward): how many keys the longest request has (or
    the static maximum in a CUDA-graphed step), and the step's number, which keys the decode mask
    every layer shares. The forward itself then reads nothing from the device."""

    keys = 0
    number = 0


def plan_step(max_keys: int) -> None:
    _Step.keys = max_keys
    _Step.number += 1


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal=True, softmax_scale=None,
                            max_seqlen_k: int | None = None, **_unused):
    """Decode: q (B, 1, heads, d) against each request's first cache_seqlens[b] cached keys, over
    max_seqlen_k keys (default: the step's, plan_step).

    On the CPU the query heads sharing a key/value head are the rows of one
    scaled_dot_product_attention call on that head (padded to MIN_GEMM_ROWS rows): torch's CPU flash
    kernel then computes every head exactly as the training forward's causal attention computes that
    token, so that rollout and training logprobs agree bit for bit here. It reads the gathered keys in
    place (no transposed copies) and costs about half as much as explicit matmuls and softmax. The
    mask is in the query's dtype: a float32 mask with bf16 queries sends CUDA's SDPA to another
    kernel than training's."""
    planned = max_seqlen_k is None
    k, v = _keys(k_cache, v_cache, block_table, _Step.keys if planned else max_seqlen_k, q.device)  # (B, groups, L, d)
    b, groups, length, d = k.shape
    per_group = q.shape[2] // groups
    qg = q.reshape(b, groups, per_group, d)  # heads are ordered group-major
    if per_group < MIN_GEMM_ROWS and q.device.type == "cpu":
        qg = torch.cat([qg, qg.new_zeros(b, groups, MIN_GEMM_ROWS - per_group, d)], dim=2)
    # one mask per step on the CPU; on CUDA each layer makes its own (cheap there, and a CUDA graph
    # captured per layer must not read a tensor another layer's graph made)
    mask = _decode_mask(cache_seqlens, length, q.dtype, _Step.number if planned and q.device.type == "cpu" else None)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=softmax_scale)
    return out[:, :, :per_group].reshape(b, 1, groups * per_group, -1)


_last_mask = (None, None)  # (key, mask) of the last decode step


def _decode_mask(cache_seqlens, length, dtype, step):
    """(B, 1, 1, L) additive mask in `dtype`: 0 on each request's first cache_seqlens[b] keys, -inf
    after. The kernel would turn a boolean mask into this very tensor (the same arithmetic) on every
    call; made once per decode step (step: its number; every layer asks again) it saves about 0.3 of
    SDPA's 2 ms a call on CPU at 64 requests."""
    global _last_mask
    key = (step, torch.is_inference_mode_enabled(), length, dtype, len(cache_seqlens))
    if step is None or _last_mask[0] != key:
        valid = torch.arange(length, device=cache_seqlens.device)[None, :] < cache_seqlens.clamp(min=1)[:, None]
        mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))
        _last_mask = (key, mask[:, None, None, :])
    return _last_mask[1]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=True, block_table=None, **_unused):
    """Prefill: packed queries q (T, heads, d) of B requests against their paged caches k, v. T may
    exceed the requests' tokens (padding rows: their output is 0). max_seqlen_q and max_seqlen_k are
    host numbers; nothing is read from the device."""
    b, max_q = len(cu_seqlens_q) - 1, int(max_seqlen_q)
    q_lens, k_lens = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    requests, pos = packed_positions(cu_seqlens_q, q.shape[0])  # (T,) each
    # each row's slot in the (B, max_q + 1) grid; padding rows go to the last column, never attended
    slot = requests * (max_q + 1) + torch.where(pos < q_lens[requests], pos, max_q)
    grid = q.new_zeros(b * (max_q + 1), *q.shape[1:]).index_copy_(0, slot, q)
    padded = grid.view(b, max_q + 1, *q.shape[1:])[:, :max_q]  # (B, max_q, heads, d)
    keys, values = _keys(k, v, block_table, int(max_seqlen_k), q.device)  # (B, groups, L, d)
    key_pos = torch.arange(keys.shape[2], device=q.device)[None, None, :]  # (1, 1, L)
    query_pos = (k_lens - q_lens)[:, None, None] + torch.arange(max_q, device=q.device)[None, :, None]
    mask = (key_pos <= query_pos) & (key_pos < k_lens[:, None, None])  # (B, max_q, L)
    mask[..., 0] = True  # padding query rows: attend somewhere rather than to nothing (NaN)
    out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                         scale=softmax_scale, enable_gqa=keys.shape[1] != q.shape[1])
    out = F.pad(out.transpose(1, 2), (0, 0, 0, 0, 0, 1))  # (B, max_q + 1, heads, dv): the last column 0
    return out.flatten(0, 1).index_select(0, slot)  # values may have other channels than keys (MLA)
