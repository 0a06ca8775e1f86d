"""Core attention of the local (non-Transformer-Engine) spec, on torch's scaled_dot_product_attention.

megatron-core's local `DotProductAttention` needs equal q/k and v head sizes, so multi-latent
attention (DeepSeek) cannot be built with it. This one takes separate sizes, grouped-query
attention, causal masks aligned to the end of the keys (a KV cache holds more keys than there are
new queries), sliding windows, megatron's explicit masks, packed sequences (THD) and context
parallelism (both of which megatron leaves to Transformer Engine's attention).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def causal_mask(sq: int, sk: int, window: int = 0, device=None) -> torch.Tensor:
    """(sq, sk) bool, True where query i (at position sk - sq + i) may attend to key j."""
    return position_mask(torch.arange(sk - sq, sk, device=device), torch.arange(sk, device=device), window)


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """(len(q_pos), len(k_pos)) bool, True where a query may attend to a key, by their positions."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def load_balanced_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Which positions of a seq_len-token sequence context-parallel rank `rank` of `cp` holds.

    megatron's load-balanced split (get_batch_on_this_cp_rank, and the rotary embedding's
    get_pos_emb_on_this_cp_rank): the sequence is cut into 2 x cp chunks and rank r holds chunks r
    and 2cp - 1 - r, so that every rank gets the same share of causal attention's work.
    """
    chunk = seq_len // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def load_balanced_packed_positions(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Which positions of a packed row (samples starting at cu_seqlens, each a multiple of 2 x cp long)
    context-parallel rank `rank` holds: in every sample, megatron's load-balanced chunks of it (as
    Transformer Engine's THD layout and megatron's THD rotary embedding have them)."""
    bounds = cu_seqlens.tolist()
    return torch.cat([start + load_balanced_positions(end - start, cp, rank, cu_seqlens.device)
                      for start, end in zip(bounds[:-1], bounds[1:])])


def packed_positions(cu_seqlens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the first `rows` rows of a packed row (samples starting at cu_seqlens): each row's sample
    and its position in that sample. `rows` is a host number, so nothing is read from the device; rows
    after the last sample count as the last sample's, at positions past its end."""
    index = torch.arange(rows, device=cu_seqlens.device)
    sample = torch.searchsorted(cu_seqlens[1:], index, right=True).clamp(max=len(cu_seqlens) - 2)
    return sample, index - cu_seqlens[sample]


_last_packed_cp_mask = (None, None)  # every layer of a microbatch asks for the same mask


def _packed_cp_mask(cu_seqlens: torch.Tensor, cp: int, rank: int, window: int) -> torch.Tensor:
    """(this rank's positions, all ranks' positions) mask of a packed row split over the context-
    parallel group: causal, and within each sample. Made once per microbatch (a Python loop over
    its samples), not once per layer."""
    global _last_packed_cp_mask
    bounds = tuple(cu_seqlens.tolist())
    key = (bounds, cp, rank, window, cu_seqlens.device, torch.is_inference_mode_enabled())
    if _last_packed_cp_mask[0] != key:
        q_pos = load_balanced_packed_positions(cu_seqlens, cp, rank)
        k_pos = torch.cat([load_balanced_packed_positions(cu_seqlens, cp, r) for r in range(cp)])
        sample, _ = packed_positions(cu_seqlens, bounds[-1])
        mask = position_mask(q_pos, k_pos, window) & (sample[q_pos][:, None] == sample[k_pos][None, :])
        _last_packed_cp_mask = (key, mask)
    return _last_packed_cp_mask[1]


# torch's CPU flash-attention kernel computes a causal sequence exactly as the rollout's decode does
# when its length is a multiple of this (tests/test_paged_attention.py).
PACKED_MULTIPLE = 16

# The same kernel sums softmax(q k) v over a sequence's keys (up to 512 of them) in one GEMM, whose
# summation order depends on the number of keys once it exceeds ONE_PASS_KEYS (measured: from 208
# keys on, most tokens' outputs change with the key count; up to 192, any count from the token's
# own, rounded up to 16, gives the same numbers). So where training sequences may be longer than
# that, all attention on CPU runs over exactly `training_keys` keys (data.seq_length, set by
# build_model), the rest masked: the training forward (unpacked rows have that length; packed
# samples are padded to it) and the rollout's prefill and decode (platform/paged_attention.py).
ONE_PASS_KEYS = 192
training_keys = 0


def fixed_keys(device) -> int:
    """How many keys attention on `device` runs over (the rest masked) for every sequence it covers, so
    that its tokens agree with the training forward's bit for bit: `training_keys` on CPU when that is
    more than ONE_PASS_KEYS; 0 otherwise (each sequence over its own keys)."""
    return training_keys if device.type == "cpu" and training_keys > ONE_PASS_KEYS else 0


@dataclass
class PackedPlan:
    """How CoreAttention runs a packed row: the scaled_dot_product_attention calls as (n, idx), idx the
    rows of the packed tensors that make `samples` sequences of n tokens (row t: a zero row appended
    when `padded`), and `rows`: where each token's output lies in the calls' outputs, concatenated."""

    groups: list
    rows: torch.Tensor
    padded: bool


def packed_plan(cu_seqlens: torch.Tensor, device: torch.device, one_call: bool | None = None) -> PackedPlan:
    """The plan for samples starting at cu_seqlens (a host tensor; the plan's tensors go to `device`),
    worked out on the host before the forward (training/step.py).

    On CUDA (one_call): every sample padded to the longest with zeros after its last token, which no
    query attends to causally, in one call per layer. On the CPU: samples of one padded length per
    call, each padded to a multiple of PACKED_MULTIPLE, or to training_keys (see ONE_PASS_KEYS):
    torch's flash kernel then computes every token as the unpacked forward and the rollout's decode
    do, bit for bit."""
    one_call = device.type == "cuda" if one_call is None else one_call
    cu = cu_seqlens.long()
    t, starts, lengths = int(cu[-1]), cu[:-1], cu.diff()
    multiple = PACKED_MULTIPLE if device.type == "cpu" and not one_call else 1
    padded = -(-lengths // multiple) * multiple
    fixed = fixed_keys(device)
    if fixed:  # long sequences: every sample over that many keys
        padded = torch.where(lengths <= fixed, fixed, padded)
    if one_call:
        padded = torch.full_like(lengths, int(padded.max()))
    groups, rows, done = [], torch.empty(t, dtype=torch.long), 0
    for n in padded.unique().tolist():
        chosen = padded == n
        offsets = torch.arange(n)
        real = (offsets < lengths[chosen][:, None]).flatten()  # (samples * n)
        idx = torch.where(real, (starts[chosen][:, None] + offsets).flatten(), t)
        groups.append((n, idx.to(device)))
        rows[idx[real]] = done + real.nonzero().squeeze(1)
        done += len(idx)
    return PackedPlan(groups, rows.to(device), bool((padded != lengths).any()))


class CoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        self.cp = config.context_parallel_size
        if self.cp > 1:
            from megatron.core import parallel_state as ps

            self.cp_group = pg_collection.cp if pg_collection is not None else ps.get_context_parallel_group()
        self.attn_mask_type = attn_mask_type
        self.scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window = config.window_size[0] + 1 if config.window_size else 0

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        """query (sq, b, heads, dk), key (sk, b, groups, dk), value (sk, b, groups, dv) -> (sq, b, heads * dv)."""
        if attention_bias is not None:
            raise NotImplementedError("attention bias needs Transformer Engine's attention.")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.cp > 1:
            return self._context_parallel(query, key, value, attention_mask)
        sq, b, heads, _ = query.shape
        sk, groups = key.shape[0], key.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads or groups, s, d)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask, is_causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask  # megatron's masks are True where attention is *not* allowed
        elif mask_type == AttnMaskType.causal:
            if sq == sk and not self.window:
                is_causal = True
            else:
                mask = causal_mask(sq, sk, self.window, device=q.device)
        if self.window and attention_mask is not None:
            mask = mask & causal_mask(sq, sk, self.window, device=q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=groups != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # (sq, b, heads * dv)

    def _packed(self, query, key, value, params):
        """Causal attention within each sample of a packed row (THD: query (t, heads, dk), key and value
        (t, groups, d), samples starting at cu_seqlens) -> (t, heads * dv): one
        scaled_dot_product_attention call per group of the plan's (packed_plan), from indices made on
        the host, so that nothing here reads the device."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if self.cp > 1:
            return self._packed_context_parallel(query, key, value, cu)
        plan = getattr(params, "attention_plan", None)
        if plan is None:  # a caller without the training step's plan (reads cu_seqlens from the device)
            plan = packed_plan(cu.cpu(), query.device)
        heads, groups = query.shape[1], key.shape[1]
        if plan.padded:  # row t: zeros, where padding slots read from
            query, key, value = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (query, key, value))
        outs = []
        for n, idx in plan.groups:
            q, k, v = (x.index_select(0, idx).view(-1, n, *x.shape[1:]).transpose(1, 2)
                       for x in (query, key, value))  # (samples, heads or groups, n, d)
            mask = causal_mask(n, n, self.window, device=q.device) if self.window else None
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                               dropout_p=self.dropout if self.training else 0.0,
                                               enable_gqa=groups != heads)
            outs.append(o.transpose(1, 2).reshape(-1, heads, o.shape[-1]))  # (samples * n, heads, dv)
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        # Rows are gathered and put back with index_select, whose backward (index_add) is about 10x
        # faster on CPU than advanced indexing's (index_put with accumulation).
        return out.index_select(0, plan.rows).reshape(plan.rows.shape[0], -1)

    def _packed_context_parallel(self, query, key, value, cu):
        """A packed row split over the context-parallel group (load_balanced_packed_positions): this
        rank's queries attend to the gathered keys of their own sample, causally."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        heads = query.shape[1]
        key, value = (gather_from_sequence_parallel_region(t, group=self.cp_group) for t in (key, value))
        mask = _packed_cp_mask(cu, self.cp, torch.distributed.get_rank(self.cp_group), self.window)
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # (1, heads or groups, t, d)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=key.shape[1] != heads)
        return out[0].transpose(0, 1).reshape(query.shape[0], -1)

    def _context_parallel(self, query, key, value, attention_mask):
        """Causal attention of this rank's queries to the keys of the whole sequence: all-gather the
        keys and values over the context-parallel group (the backward reduce-scatters their
        gradients), then mask by the positions each rank holds."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if attention_mask is not None:
            raise NotImplementedError("context parallelism with an explicit attention mask (padding, "
                                      "packing) needs Transformer Engine's attention; use parallel.cp=1.")
        sq, b, heads, _ = query.shape
        key, value = (gather_from_sequence_parallel_region(t, group=self.cp_group) for t in (key, value))
        rank, length = torch.distributed.get_rank(self.cp_group), sq * self.cp
        q_pos = load_balanced_positions(length, self.cp, rank, query.device)
        k_pos = torch.cat([load_balanced_positions(length, self.cp, r, query.device) for r in range(self.cp)])
        mask = position_mask(q_pos, k_pos, self.window)  # keys in gathered (rank) order
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads or groups, s, d)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=key.shape[2] != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
