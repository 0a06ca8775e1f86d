"""The torch Mamba-2 kernels (megatron_rl/platform/mamba_ops.py) against a token-by-token recurrence
in float64, on packed sequences: outputs, final and per-sequence states, and no leak between
sequences."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.platform import mamba_ops as ops

H, P, G, N = 4, 3, 2, 5  # heads, head dim, groups, state size


def _inputs(length=23, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return dict(x=r(batch, length, H, P), dt=r(batch, length, H), A=-torch.rand(H, generator=g) * 2 - 0.1,
                B=r(batch, length, G, N), C=r(batch, length, G, N), D=r(H), z=r(batch, length, H, P),
                dt_bias=r(H) * 0.5)


def recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, dt_softplus=True,
               dt_limit=(0.0, math.inf)):
    """h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t (h reset where a new sequence starts), y_t = C_t h_t
    + D x_t, gated by silu(z_t). Returns y and the state after every token, in float64."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    b, length, h, p = x.shape
    dt = dt + (dt_bias.double() if dt_bias is not None else 0)
    if dt_softplus:
        dt = torch.where(dt <= 20, F.softplus(dt), dt)
    dt = dt.clamp(*dt_limit)
    Bh, Ch = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (B, C))
    state = initial_states.double() if initial_states is not None else x.new_zeros(b, h, p, B.shape[-1])
    ys, states = [], []
    for t in range(length):
        if seq_idx is not None and t > 0:
            new = (seq_idx[:, t] != seq_idx[:, t - 1]).double()[:, None, None, None]
            state = state * (1 - new)
        elif seq_idx is not None and t == 0:
            state = state * (seq_idx[:, 0] == 0).double()[:, None, None, None]
        state = state * torch.exp(dt[:, t, :, None, None] * A.double()[None, :, None, None]) + \
            (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", state, Ch[:, t])
        if D is not None:
            y = y + x[:, t] * (D.double() if D.dim() == 2 else D.double()[:, None])
        if z is not None:
            y = y * F.silu(z[:, t].double())
        ys.append(y)
        states.append(state)
    return torch.stack(ys, 1), torch.stack(states, 1)


def _close(a, b, tol=1e-5):
    assert torch.allclose(a.double(), b.double(), atol=tol, rtol=tol), (a.double() - b.double()).abs().max()


@pytest.mark.parametrize("chunk_size", [4, 8, 64])
def test_chunk_scan_equals_the_recurrence_on_packed_sequences(chunk_size):
    """Three sequences packed in one row (lengths 9, 3, 11: boundaries inside and across chunks), D
    per head, z gating, dt_limit: the output, the final state and each sequence's last state."""
    inp = _inputs()
    cu = torch.tensor([0, 9, 12, 23], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), cu.diff())[None]
    kwargs = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], seq_idx=seq_idx, dt_limit=(0.01, 5.0))
    y, final, varlen = ops.mamba_chunk_scan_combined(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size, cu_seqlens=cu, dt_softplus=True,
        return_final_states=True, return_varlen_states=True, **kwargs)
    ref_y, ref_states = recurrence(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], **kwargs)
    _close(y, ref_y)
    _close(final, ref_states[:, -1])
    _close(varlen, ref_states[0, cu[1:] - 1])


def test_chunk_scan_does_not_leak_between_sequences():
    """Changing the second sequence's tokens leaves the first's outputs bit for bit, and the other
    way round the second's outputs do not depend on the first (state and chunk boundaries)."""
    inp = _inputs()
    seq_idx = torch.tensor([[0] * 10 + [1] * 13], dtype=torch.int32)
    run = lambda d: ops.mamba_chunk_scan_combined(d["x"], d["dt"], d["A"], d["B"], d["C"], 4, D=d["D"],  # noqa: E731
                                                  dt_bias=d["dt_bias"], seq_idx=seq_idx, dt_softplus=True)
    base = run(inp)
    later = {k: v.clone() for k, v in inp.items()}
    for k in ("x", "B", "C", "dt"):
        later[k][:, 10:] = torch.randn_like(later[k][:, 10:])
    assert torch.equal(run(later)[:, :10], base[:, :10])
    earlier = {k: v.clone() for k, v in inp.items()}
    for k in ("x", "B", "C", "dt"):
        earlier[k][:, :10] = torch.randn_like(earlier[k][:, :10])
    _close(run(earlier)[:, 10:], base[:, 10:], tol=1e-6)
    alone = ops.mamba_chunk_scan_combined(*(inp[k][:, 10:] for k in ("x", "dt")), inp["A"],
                                          *(inp[k][:, 10:] for k in ("B", "C")), 4, D=inp["D"],
                                          dt_bias=inp["dt_bias"], dt_softplus=True)
    _close(alone, base[:, 10:], tol=1e-6)


def test_chunk_scan_initial_states_and_head_dim_d_and_batches():
    """initial_states (chunked prefill continues a request), D with a head dimension, batch 2."""
    inp = _inputs(length=13, batch=2, seed=1)
    initial = torch.randn(2, H, P, N)
    D = torch.randn(H, P)
    y, final = ops.mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 4, D=D,
                                             initial_states=initial, dt_softplus=False, return_final_states=True)
    ref_y, ref_states = recurrence(inp["x"], inp["dt"].abs(), inp["A"], inp["B"], inp["C"], D=D,
                                   initial_states=initial, dt_softplus=False)
    y2 = ops.mamba_chunk_scan_combined(inp["x"], inp["dt"].abs(), inp["A"], inp["B"], inp["C"], 4, D=D,
                                       initial_states=initial)
    _close(y2, ref_y)
    assert y.shape == ref_y.shape and final.shape == (2, H, P, N)
    # one long prompt in two pieces: the second started from the first's final state
    first, state = ops.mamba_chunk_scan_combined(*(inp[k][:, :6] for k in ("x", "dt")), inp["A"],
                                                 *(inp[k][:, :6] for k in ("B", "C")), 4, dt_softplus=True,
                                                 return_final_states=True)
    second = ops.mamba_chunk_scan_combined(*(inp[k][:, 6:] for k in ("x", "dt")), inp["A"],
                                           *(inp[k][:, 6:] for k in ("B", "C")), 4, dt_softplus=True,
                                           initial_states=state)
    whole = ops.mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 4, dt_softplus=True)
    _close(torch.cat([first, second], 1), whole)


def _conv_reference(x, weight, bias, lengths):
    """nn.Conv1d-style causal convolution of each sequence on its own, then silu."""
    outs, start = [], 0
    for n in lengths:
        piece = x[:, :, start:start + n]
        outs.append(F.silu(F.conv1d(piece, weight[:, None], bias, padding=weight.shape[1] - 1,
                                    groups=x.shape[1])[..., :n]))
        start += n
    return torch.cat(outs, dim=2)


def test_causal_conv1d_on_packed_sequences_and_in_decode():
    g = torch.Generator().manual_seed(2)
    d, width, lengths = 6, 4, [5, 2, 7]
    x = torch.randn(1, d, sum(lengths), generator=g)
    weight, bias = torch.randn(d, width, generator=g), torch.randn(d, generator=g)
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None].int()
    out = ops.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    _close(out, _conv_reference(x, weight, bias, lengths))
    # each sequence's conv state after prefill, then decode token by token from it
    cu = torch.tensor([0, 5, 7, 14])
    states = ops.causal_conv1d_varlen_states(x[0].T.contiguous(), cu, state_len=width)
    assert states.shape == (3, d, width)
    assert torch.equal(states[1, :, :2], torch.zeros(d, 2)) and torch.equal(states[1, :, 2:], x[0, :, 5:7])
    follow = torch.randn(3, d, 3, generator=g)
    pool = torch.zeros(5, d, width)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)
    pool[rows.long()] = states
    steps = [ops.causal_conv1d_update(follow[:, :, t], pool, weight, bias, "silu", conv_state_indices=rows)
             for t in range(3)]
    for i, (start, n) in enumerate(zip([0, 5, 7], lengths)):
        whole = torch.cat([x[:, :, start:start + n], follow[i:i + 1]], dim=2)
        expected = _conv_reference(whole, weight, bias, [n + 3])[0, :, n:]
        _close(torch.stack([s[i] for s in steps], dim=1), expected)
    assert torch.equal(pool[1], torch.zeros(d, width))  # a row no request owns is untouched
    # initial_states: a second piece of one sequence continues the first
    first, final = ops.causal_conv1d_fn(x[:, :, :5], weight, bias, activation="silu", return_final_states=True)
    second = ops.causal_conv1d_fn(x[:, :, 5:9], weight, bias, initial_states=final, activation="silu")
    _close(torch.cat([first, second], 2), _conv_reference(x[:, :, :9], weight, bias, [9]))


def test_selective_state_update_equals_the_recurrence():
    """Decode steps on state rows picked by index, with head-dim dt/D/dt_bias and A as megatron
    passes them (repeated over the head dim and state), and z gating."""
    inp = _inputs(length=4, batch=2, seed=3)
    ref_y, _ = recurrence(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"], z=inp["z"],
                          dt_bias=inp["dt_bias"])
    pool = torch.zeros(3, H, P, N)
    rows = torch.tensor([2, 0])
    A = inp["A"][:, None, None].expand(H, P, N)
    for t in range(4):
        y = ops.selective_state_update(
            pool, inp["x"][:, t], inp["dt"][:, t, :, None].expand(2, H, P), A, inp["B"][:, t], inp["C"][:, t],
            D=inp["D"][:, None].expand(H, P), z=inp["z"][:, t], dt_bias=inp["dt_bias"][:, None].expand(H, P),
            dt_softplus=True, state_batch_indices=rows)
        _close(y, ref_y[:, t])
    assert torch.equal(pool[1], torch.zeros(H, P, N))


def test_split_conv1d_scan_combined_is_conv_then_scan_then_gate():
    """The training kernel equals its parts: convolution (per sequence), scan, z gating; and with
    rmsnorm_weight, the grouped gated norm."""
    g = torch.Generator().manual_seed(4)
    b, length, width = 1, 17, 4
    dim, conv_dim = H * P, H * P + 2 * G * N
    zxbcdt = torch.randn(b, length, 2 * dim + 2 * G * N + H, generator=g)
    weight, bias = torch.randn(conv_dim, width, generator=g) * 0.5, torch.randn(conv_dim, generator=g)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.1, torch.randn(H, generator=g), torch.randn(H, generator=g)
    seq_idx = torch.tensor([[0] * 8 + [1] * 9], dtype=torch.int32)
    out = ops.mamba_split_conv1d_scan_combined(zxbcdt, weight, bias, dt_bias, A, D, 4, seq_idx=seq_idx, headdim=P,
                                               ngroups=G)
    z, xBC, dt = torch.split(zxbcdt, [dim, conv_dim, H], dim=-1)
    xBC = _conv_reference(xBC.transpose(1, 2), weight, bias, [8, 9]).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, G * N, G * N], dim=-1)
    ref_y, _ = recurrence(x.reshape(b, length, H, P), dt, A, B.reshape(b, length, G, N), C.reshape(b, length, G, N),
                          D=D, z=z.reshape(b, length, H, P), dt_bias=dt_bias, seq_idx=seq_idx)
    _close(out, ref_y.reshape(b, length, dim))
    norm_w = torch.randn(dim, generator=g)
    normed = ops.mamba_split_conv1d_scan_combined(zxbcdt, weight, bias, dt_bias, A, D, 4, seq_idx=seq_idx, headdim=P,
                                                  ngroups=G, rmsnorm_weight=norm_w, norm_before_gate=False)
    plain, _ = recurrence(x.reshape(b, length, H, P), dt, A, B.reshape(b, length, G, N), C.reshape(b, length, G, N),
                          D=D, dt_bias=dt_bias, seq_idx=seq_idx)
    gated = plain.reshape(b, length, dim) * F.silu(z.double())
    groups = gated.unflatten(-1, (G, dim // G))
    expected = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + 1e-6)).flatten(-2) * norm_w.double()
    _close(normed, expected)


def test_gated_rmsnorm_equals_transformers_nemotron_h():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    g = torch.Generator().manual_seed(5)
    x, z = torch.randn(3, 7, 12, generator=g), torch.randn(3, 7, 12, generator=g)
    theirs = NemotronHRMSNormGated(12, group_size=4, eps=1e-5)
    ours = ops.RMSNormGated(12, eps=1e-5, group_size=4, norm_before_gate=False)
    with torch.no_grad():
        theirs.weight.normal_(generator=g)
        ours.weight.copy_(theirs.weight)
    _close(ours(x, z), theirs(x, gate=z), tol=1e-6)
    assert ours.bias is None and torch.equal(ops.RMSNormGated(12).weight, torch.ones(12))


def test_tensor_ops():
    a, b = torch.arange(12.).view(6, 2), -torch.arange(8.).view(4, 2) - 1
    out = torch.zeros(4, 2)
    ops.tensor_get_slice_after(a, out, torch.tensor([3]))
    assert torch.equal(out[:3], a[3:]) and torch.equal(out[3], torch.zeros(2))
    merged = torch.full((7, 2), 9.)
    ops.tensor_merge(a, b, torch.tensor([2]), output_tensor=merged)
    assert torch.equal(merged[:2], a[:2]) and torch.equal(merged[2:6], b)
    assert torch.equal(merged[6], torch.full((2,), 9.))
    inplace = a.clone()
    ops.tensor_merge(inplace, b[:2], torch.tensor([1]))
    assert torch.equal(inplace, torch.cat([a[:1], b[:2], a[3:]]))
    states = torch.zeros(5, 2, 3)
    new = torch.ones(3, 2, 3) * torch.tensor([1., 2., 3.])[:, None, None]
    ops.tensor_masked_update(states, torch.tensor([3, -1, 0]), new)
    assert torch.equal(states[3], torch.ones(2, 3)) and torch.equal(states[0], 3 * torch.ones(2, 3))
    assert states[[1, 2, 4]].abs().sum() == 0


def _mixers(chunk_size=4, mem_eff=True):
    """megatron-core's MambaMixer (local linear layers, our kernels) and transformers' NemotronH
    Mamba-2 mixer (its torch path), with the same random weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    hidden, heads, head_dim, groups, state, width = 32, 4, 8, 2, 8, 4
    hf = NemotronHMamba2Mixer(NemotronHConfig(
        hidden_size=hidden, num_hidden_layers=1, hybrid_override_pattern="M", mamba_num_heads=heads,
        mamba_head_dim=head_dim, n_groups=groups, ssm_state_size=state, conv_kernel=width, chunk_size=chunk_size,
        layer_norm_epsilon=1e-5, vocab_size=50), layer_idx=0).eval()
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, mamba_state_dim=state,
                               mamba_head_dim=head_dim, mamba_num_groups=groups, mamba_num_heads=heads,
                               use_mamba_mem_eff_path=mem_eff, use_cpu_initialization=True)
    ours = MambaMixer(config, MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                      d_model=hidden, d_conv=width, chunk_size=chunk_size, layer_number=1,
                      pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0))
        hf.A_log.copy_(torch.rand(heads, generator=g).log())
        ours_params = dict(ours.named_parameters())
        for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                     "out_proj.weight"):
            ours_params[name].copy_(dict(hf.named_parameters())[name])
    return ours, hf


def test_megatron_mamba_mixer_equals_transformers_on_every_path(one_process):
    """megatron's training path (the fused split-conv-scan), its prefill path (conv, then scan, then
    the gated norm) and its decode path (conv and state updates token by token) each give
    transformers' NemotronH mixer output; packed training sequences give each sequence's own."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ours, hf = _mixers()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 11, 32, generator=g)
    with torch.no_grad():
        expected = hf(x)
        ours.train()
        trained, _ = ours(x.transpose(0, 1))
        _close(trained.transpose(0, 1), expected, tol=1e-4)
        zxBCdt, _ = ours.in_proj(x.transpose(0, 1))
        prefill = ours._ssm_prefill(zxBCdt, conv_state=None, ssm_state=None)
        _close(ours.out_proj(prefill)[0].transpose(0, 1), expected, tol=1e-4)
        conv_state, ssm_state = (torch.zeros(1, *shape) for shape in ours.mamba_state_shapes_per_request())
        steps = [ours._ssm_decode(zxBCdt[t:t + 1], conv_state, ssm_state) for t in range(11)]
        _close(ours.out_proj(torch.cat(steps))[0].transpose(0, 1), expected, tol=1e-4)
        # two sequences packed in one row: each gets what it gets alone
        y = torch.randn(1, 6, 32, generator=g)
        cu = torch.tensor([0, 11, 17], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11, max_seqlen_kv=11)
        both, _ = ours(torch.cat([x, y], 1).transpose(0, 1), packed_seq_params=packed)
        _close(both.transpose(0, 1), torch.cat([expected, hf(y)], 1), tol=1e-4)


def test_decode_padding_slots_touch_no_state():
    """The dynamic engine pads a decode step's batch with slot index -1: those rows must neither read
    nor write any request's state (Python's index -1 would be the last request's), and output 0."""
    inp = _inputs(length=1, batch=3, seed=8)
    pool, rows = torch.randn(4, H, P, N), torch.tensor([3, -1, 0])
    before = pool.clone()
    A = inp["A"][:, None, None].expand(H, P, N)
    y = ops.selective_state_update(pool, inp["x"][:, 0], inp["dt"][:, 0, :, None].expand(3, H, P), A, inp["B"][:, 0],
                                   inp["C"][:, 0], dt_softplus=True, state_batch_indices=rows)
    assert torch.equal(pool[1:3], before[1:3]) and not torch.equal(pool[3], before[3])
    assert torch.equal(y[1], torch.zeros(H, P))
    conv = torch.randn(4, 6, 4)
    kept = conv.clone()
    out = ops.causal_conv1d_update(torch.randn(3, 6), conv, torch.randn(6, 4), None, "silu", conv_state_indices=rows)
    assert torch.equal(conv[1:3], kept[1:3]) and torch.equal(out[1], torch.zeros(6))


def test_padding_tokens_carry_no_input():
    """megatron's dynamic engine marks padding tokens with seq_idx -1, and their rows may hold
    uninitialized memory: NaN there must not reach any real token (a masked product 0 x NaN would)."""
    inp = _inputs(length=12, seed=9)
    seq_idx = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3], dtype=torch.int32)
    dirty = {k: v.clone() for k, v in inp.items()}
    for k in ("x", "B", "C", "dt"):
        dirty[k][:, 9:] = float("nan")
    run = lambda d: ops.mamba_chunk_scan_combined(d["x"], d["dt"], d["A"], d["B"], d["C"], 4, D=d["D"],  # noqa: E731
                                                  dt_bias=d["dt_bias"], seq_idx=seq_idx, dt_softplus=True)
    assert torch.equal(run(dirty)[:, :9], run(inp)[:, :9]) and run(dirty)[:, :9].isfinite().all()
    x = torch.randn(1, 6, 12)
    x_dirty = x.clone()
    x_dirty[:, :, 9:] = float("nan")
    weight = torch.randn(6, 4)
    assert torch.equal(ops.causal_conv1d_fn(x_dirty, weight, seq_idx=seq_idx, activation="silu")[:, :, :9],
                       ops.causal_conv1d_fn(x, weight, seq_idx=seq_idx, activation="silu")[:, :, :9])
