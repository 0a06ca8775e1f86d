"""Mamba-2 kernels in torch, for megatron-core's MambaMixer where mamba_ssm and causal_conv1d are absent.

megatron-core's Mamba layer calls Triton/CUDA kernels from mamba_ssm and causal_conv1d by name,
and its dynamic inference engine three Triton tensor helpers. These are torch versions with the
kernels' own signatures and semantics, including what transformers' torch fallbacks leave out:
`seq_idx` (packed sequences: no state, and no convolution window, crosses a sequence boundary),
`cu_seqlens` with per-sequence final states, `initial_states`, `dt_limit`, D with and without a
head dimension, z gating and the grouped gated RMSNorm. Arithmetic is fp32 inside (as the kernels
accumulate), results in the input's dtype; SSM states keep their own dtype.

The scan is the chunked state-space-duality algorithm (Mamba-2, section 6): within a chunk, a
masked (causal, same-sequence) decay matrix; between chunks, states passed on one chunk at a time.
tests/test_mamba_ops.py checks every function against a token-by-token recurrence.
"""

import math

import torch
import torch.nn.functional as F

__all__ = ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "causal_conv1d_fn",
           "causal_conv1d_update", "causal_conv1d_varlen_states", "selective_state_update", "RMSNormGated",
           "rmsnorm_fn", "tensor_get_slice_after", "tensor_merge", "tensor_masked_update"]

MAMBA_SSM_VERSION = "2.2.6.post3"
"""The mamba_ssm version these stand in for (megatron-core 0.16.1 asks for at least this one to
pack sequences in inference)."""
CAUSAL_CONV1D_VERSION = "1.5.3.post1"


def _softplus(x):
    """The kernels' softplus: the identity above 20."""
    return torch.where(x <= 20.0, F.softplus(x), x)


def _dt(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = _softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    return dt


def _heads(t, heads):
    """(..., groups, n) -> (..., heads, n): each group serves heads // groups consecutive heads."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """The selective scan of Mamba-2 over whole sequences.

    x: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A: (nheads,);
    B, C: (batch, seqlen, ngroups, dstate); D: (nheads, headdim) or (nheads,); z: like x;
    dt_bias: (nheads,); initial_states: (batch, nheads, headdim, dstate), the state before the first
    token (which belongs to sequence 0 under seq_idx); seq_idx: (batch, seqlen) int, non-decreasing
    but for -1 on padding tokens;
    cu_seqlens: (num_sequences + 1,), with batch 1, for return_varlen_states.
    Returns out (batch, seqlen, nheads, headdim), then the final states (batch, nheads, headdim,
    dstate) if return_final_states, then each sequence's last state (num_sequences, nheads,
    headdim, dstate) if return_varlen_states."""
    b, length, h, p = x.shape
    dt = _dt(dt, dt_bias, dt_softplus, dt_limit)
    if seq_idx is not None:    # -1 marks padding (megatron's dynamic engine; its rows may be
        padding = seq_idx < 0  # uninitialized memory): no input from there, as the kernels load none
        x, B, C = (t.masked_fill(padding[:, :, None, None], 0) for t in (x, B, C))
        dt = dt.masked_fill(padding[:, :, None], 0)
    pad = -length % chunk_size
    # padded tokens: dt = 0 (no decay, no input), in the last token's sequence
    xs, Bs, Cs = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dts = F.pad(dt, (0, 0, 0, pad))
    seq = (seq_idx if seq_idx is not None else x.new_zeros(b, length, dtype=torch.int32)).long()
    seq = torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1)
    nc, cs = (length + pad) // chunk_size, chunk_size
    xs = xs.view(b, nc, cs, h, p)
    Bh, Ch = (_heads(t, h).view(b, nc, cs, h, -1) for t in (Bs, Cs))
    dts = dts.view(b, nc, cs, h)
    seq = seq.view(b, nc, cs)
    cum = torch.cumsum(dts * A.float(), dim=2)  # (b, nc, cs, h): log-decay from the chunk start
    same = seq[:, :, :, None] == seq[:, :, None, :]  # (b, nc, t, s)
    causal = torch.ones(cs, cs, dtype=torch.bool, device=x.device).tril()
    seg = cum.permute(0, 1, 3, 2)[..., :, None] - cum.permute(0, 1, 3, 2)[..., None, :]  # (b, nc, h, t, s)
    decay = torch.exp(seg.masked_fill(~(same & causal)[:, :, None], -math.inf))
    # within chunks: y_t = sum_{s <= t, same sequence} C_t.B_s exp(cum_t - cum_s) dt_s x_s
    weights = torch.einsum("bclhn,bcshn->bchls", Ch, Bh) * decay * dts.permute(0, 1, 3, 2)[:, :, :, None, :]
    y = torch.einsum("bchls,bcshp->bclhp", weights, xs)
    # each chunk's own contribution to the state at its last token
    to_end = decay[:, :, :, -1, :] * dts.permute(0, 1, 3, 2)  # (b, nc, h, s)
    chunk_states = torch.einsum("bchs,bcshn,bcshp->bchpn", to_end, Bh, xs)
    # between chunks: the state after chunk c-1 decays into chunk c while the sequence goes on
    state = initial_states.float() if initial_states is not None else x.new_zeros(b, h, p, Bh.shape[-1],
                                                                                      dtype=torch.float32)
    prev_seq = torch.zeros(b, dtype=torch.long, device=x.device)  # the initial state is sequence 0's
    entering = []
    for c in range(nc):
        entering.append((state, prev_seq))
        keeps = (seq[:, c, -1] == prev_seq).float()[:, None]  # (b, 1)
        state = state * (torch.exp(cum[:, c, -1]) * keeps)[:, :, None, None] + chunk_states[:, c]
        prev_seq = seq[:, c, -1]
    before = torch.stack([s for s, _ in entering], dim=1)  # (b, nc, h, p, n)
    before_seq = torch.stack([q for _, q in entering], dim=1)  # (b, nc)
    carried = (seq == before_seq[:, :, None]).float()[..., None] * torch.exp(cum)  # (b, nc, cs, h)
    y = y + torch.einsum("bclhn,bchpn,bclh->bclhp", Ch, before, carried)
    y = y.reshape(b, nc * cs, h, p)[:, :length]
    if D is not None:
        y = y + x.float() * (D.float() if D.dim() == 2 else D.float()[:, None])
    if z is not None:
        y = y * F.silu(z.float())
    out = [y.to(x.dtype)]
    if return_final_states:
        out.append(state.to(x.dtype))
    if return_varlen_states:
        assert b == 1 and cu_seqlens is not None, "return_varlen_states needs batch 1 and cu_seqlens"
        ends = cu_seqlens[1:].long() - 1
        c, t = ends // cs, ends % cs
        # the state at token t of chunk c: what entered chunk c (if the sequence goes on) decayed
        # to t, plus the chunk's tokens up to t of t's sequence
        row = decay[0, c, :, t, :] * dts[0, c].permute(0, 2, 1)  # (seqs, h, s)
        own = torch.einsum("ihs,ishn,ishp->ihpn", row, Bh[0, c], xs[0, c])
        carry = (seq[0, c, t] == before_seq[0, c]).float()[:, None] * torch.exp(cum[0, c, t])  # (seqs, h)
        out.append((own + before[0, c] * carry[:, :, None, None]).to(x.dtype))
    return out[0] if len(out) == 1 else tuple(out)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """A Mamba-2 layer's middle from its input projection: split z | xBC | dt, causal convolution
    of xBC (silu), the scan with softplus(dt + dt_bias), then z gating (or the gated RMSNorm when
    rmsnorm_weight is given) and the optional output projection.

    zxbcdt: (batch, seqlen, 2 * dim + 2 * ngroups * dstate + nheads), dim = nheads * headdim;
    conv1d_weight: (dim + 2 * ngroups * dstate, width); D: (nheads, headdim) or (nheads,) with
    headdim given. Returns (batch, seqlen, dim) (or the projection's width), and the final states
    if return_final_states."""
    nheads, headdim = (D.shape[0], headdim) if D.dim() == 1 else D.shape
    dim = nheads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - nheads) // ngroups // 2
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    b, length = zxbcdt.shape[:2]
    z = z.reshape(b, length, nheads, headdim)
    result = mamba_chunk_scan_combined(
        x.reshape(b, length, nheads, headdim), dt, A, B.reshape(b, length, ngroups, dstate),
        C.reshape(b, length, ngroups, dstate), chunk_size, D=D, z=z if rmsnorm_weight is None else None,
        dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states)
    y, final = result if return_final_states else (result, None)
    y = y.reshape(b, length, dim)
    if rmsnorm_weight is not None:
        y = rmsnorm_fn(y, rmsnorm_weight, None, z=z.reshape(b, length, dim), eps=rmsnorm_eps, group_size=dim // ngroups,
                       norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """Depthwise causal convolution. x: (batch, dim, seqlen); weight: (dim, width); seq_idx:
    (batch, seqlen): a window never reaches into an earlier sequence; initial_states: (batch, dim,
    width - 1), the inputs before the first. Returns (batch, dim, seqlen), and the last width - 1
    inputs as (batch, dim, width - 1) if return_final_states."""
    assert activation in (None, "silu", "swish")
    assert seq_idx is None or initial_states is None, "causal_conv1d: seq_idx and initial_states do not combine"
    b, d, length = x.shape
    width = weight.shape[1]
    if seq_idx is not None:  # -1 marks padding, whose rows may be uninitialized memory: no input there
        x = x.masked_fill(seq_idx[:, None, :] < 0, 0)
    before = initial_states if initial_states is not None else x.new_zeros(b, d, width - 1)
    padded = torch.cat([before.to(x.dtype), x], dim=2).float()
    out = bias.float()[None, :, None].expand(b, d, length).clone() if bias is not None else x.new_zeros(
        b, d, length, dtype=torch.float32)
    for lag in range(width):  # weight[:, -1] takes the current input, weight[:, -1 - lag] the one lag back
        tap = weight[:, width - 1 - lag].float()[None, :, None]
        term = padded[:, :, width - 1 - lag: width - 1 - lag + length] * tap
        if seq_idx is not None and lag:
            same = torch.zeros_like(seq_idx, dtype=torch.bool)
            same[:, lag:] = seq_idx[:, lag:] == seq_idx[:, :-lag]
            term = term * same[:, None, :]
        out = out + term
    if activation is not None:
        out = F.silu(out)
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    final = padded[:, :, -(width - 1):].to(x.dtype) if width > 1 else x.new_zeros(b, d, 0)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """Decode: x (batch, dim) or (batch, dim, seqlen) new inputs after each request's conv_state
    (batch_state, dim, state_len >= width - 1, updated in place: shifted left, the inputs at the
    end), at rows conv_state_indices (batch,) if given (-1: padding, no state, output 0). Returns the
    outputs, shaped like x."""
    assert cache_seqlens is None, "circular conv states (cache_seqlens) are not supported"
    assert activation in (None, "silu", "swish")
    single = x.dim() == 2
    xs = x[:, :, None] if single else x
    rows = conv_state_indices.long() if conv_state_indices is not None else torch.arange(xs.shape[0],
                                                                                        device=x.device)
    width, length = weight.shape[1], xs.shape[2]
    out = torch.zeros_like(xs)
    real = (rows >= 0).nonzero()[:, 0]  # index -1 is a padding slot: no state to read or write
    rows = rows[real]
    window = torch.cat([conv_state[rows], xs[real].to(conv_state.dtype)], dim=2)  # (batch, dim, state_len + seqlen)
    conv_state[rows] = window[:, :, -conv_state.shape[2]:]
    out[real] = causal_conv1d_fn(window[:, :, -(width - 1 + length):].to(x.dtype), weight, bias,
                                 activation=activation)[:, :, width - 1:]
    return out[:, :, 0] if single else out


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """For packed sequences x (total_tokens, dim) with boundaries cu_seqlens (batch + 1,): each
    sequence's last state_len inputs, zero where the sequence is shorter, as (batch, dim, state_len)."""
    ends = cu_seqlens[1:].long()
    starts = cu_seqlens[:-1].long()
    positions = ends[:, None] - state_len + torch.arange(state_len, device=x.device)[None, :]  # (batch, state_len)
    valid = positions >= starts[:, None]
    states = x[positions.clamp(min=0)] * valid[:, :, None]  # (batch, state_len, dim)
    return states.transpose(1, 2).contiguous()


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """One decode step of the scan, updating `state` in place at rows state_batch_indices (all rows
    in order if None; a row index of -1 marks padding, which reads and writes no state and outputs 0). With heads: state (batch, nheads, dim, dstate), x and dt (batch, nheads, dim),
    A (nheads, dim, dstate), B and C (batch, ngroups, dstate), D and dt_bias (nheads, dim), z like x;
    without, the nheads axis is absent. Returns (batch, nheads, dim) (or (batch, dim))."""
    if x.dim() == 2:  # no head axis: one head
        out = selective_state_update(state.unsqueeze(1), x[:, None], dt[:, None], A[None], B[:, None], C[:, None],
                                     D[None] if D is not None else None, z[:, None] if z is not None else None,
                                     dt_bias[None] if dt_bias is not None else None, dt_softplus, state_batch_indices)
        return out[:, 0]
    rows = state_batch_indices.long() if state_batch_indices is not None else torch.arange(x.shape[0],
                                                                                           device=x.device)
    batch = x.shape[0]
    real = (rows >= 0).nonzero()[:, 0]  # index -1 is a padding slot: no state to read or write
    rows, x, dt, B, C = rows[real], x[real], dt[real], B[real], C[real]
    heads = x.shape[1]
    dt = _dt(dt, dt_bias, dt_softplus, (0.0, float("inf")))  # (b, h, p)
    Bh, Ch = (_heads(t.float(), heads) for t in (B, C))  # (b, h, n)
    new = state[rows].float() * torch.exp(dt[..., None] * A.float()) + (dt * x.float())[..., None] * Bh[:, :, None, :]
    state[rows] = new.to(state.dtype)
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z[real].float())
    out = torch.zeros(batch, *y.shape[1:], dtype=x.dtype, device=x.device)
    out[real] = y.to(x.dtype)
    return out


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """RMSNorm over groups of group_size channels (all channels if None), gated by silu(z) before
    the norm (norm_before_gate=False) or after it."""
    dtype = x.dtype
    x = x.float()
    if z is not None and not norm_before_gate:
        x = x * F.silu(z.float())
    groups = x.unflatten(-1, (-1, group_size or x.shape[-1]))
    out = (groups * torch.rsqrt(groups.square().mean(dim=-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if z is not None and norm_before_gate:
        out = out * F.silu(z.float())
    return out.to(dtype)


class RMSNormGated(torch.nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: weight only (bias None), grouped, gated."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return rmsnorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                          norm_before_gate=self.norm_before_gate)


# megatron-core's Triton helpers for the dynamic engine's Mamba states
# (megatron/core/inference/contexts/attention_context/triton/tensor_ops.py).


def tensor_get_slice_after(input_tensor, output_tensor, pos_on_device, check_bounds=False):
    """output_tensor[:n] = input_tensor[pos:], n = rows after pos (at most output_tensor's rows)."""
    pos = int(pos_on_device[0])
    rows = min(input_tensor.shape[0] - pos, output_tensor.shape[0])
    if rows > 0:
        output_tensor[:rows] = input_tensor[pos:pos + rows]


def tensor_merge(tensor_a, tensor_b, pos_on_device, output_tensor=None, check_bounds=False):
    """output[:pos] = tensor_a[:pos]; output[pos:pos + len(tensor_b)] = tensor_b (in place on
    tensor_a when output_tensor is None); rows beyond stay as they are."""
    pos = int(pos_on_device[0])
    out = tensor_a if output_tensor is None else output_tensor
    if output_tensor is not None:
        out[:pos] = tensor_a[:pos]
    rows = max(0, min(tensor_b.shape[0], out.shape[0] - pos))
    out[pos:pos + rows] = tensor_b[:rows]


def tensor_masked_update(states, idx, new_states):
    """states[idx[i]] = new_states[i] for every i with idx[i] != -1."""
    keep = idx != -1
    states[idx[keep].long()] = new_states[keep].to(states.dtype)
