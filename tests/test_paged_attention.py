"""The rollout engine's paged attention (platform/paged_attention.py) against the training forward's
core attention: every token's output must be the same bit for bit, for prompts (prefill) and for
tokens generated one at a time (decode), with each request's keys in scattered cache blocks."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_rl.platform import paged_attention
from megatron_rl.platform.attention import CoreAttention

pytestmark = pytest.mark.cpu_only("bit-for-bit agreement of torch's CPU attention kernel with itself")

BLOCK = 32


def training_attention(q, k, v):
    """The training forward's causal attention (megatron's [s, b, heads, d] layout) -> (b, s, heads, d)."""
    heads, groups, d = q.shape[2], k.shape[2], q.shape[3]
    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=d)
    attention = CoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal).eval()
    with torch.no_grad():
        out = attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attention_mask=None)
    return out.view(q.shape[1], q.shape[0], heads, d).transpose(0, 1)


def paged_cache(k, v, generator):
    """k, v (b, s, groups, d) written into a block cache in scattered blocks, as megatron's dynamic
    context keeps them: (num_blocks, BLOCK, groups, d) each, and the (b, max_blocks) block table."""
    b, s = k.shape[:2]
    per_request = -(-s // BLOCK)
    num_blocks = 4 * b * per_request
    cache = torch.randn(2, num_blocks, BLOCK, *k.shape[2:], generator=generator)  # unused slots hold junk
    table = torch.randperm(num_blocks, generator=generator)[: b * per_request].view(b, per_request).int()
    for i in range(b):
        for j in range(s):
            cache[0, table[i, j // BLOCK], j % BLOCK] = k[i, j]
            cache[1, table[i, j // BLOCK], j % BLOCK] = v[i, j]
    return cache[0], cache[1], torch.cat([table, torch.full((b, 2), -1, dtype=torch.int32)], dim=1)


def random_qkv(b, s, heads, groups, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, heads, d, generator=g), torch.randn(b, s, groups, d, generator=g),
            torch.randn(b, s, groups, d, generator=g), g)


def decode_matches_training(heads, groups, seq) -> list[bool]:
    """Per token t: whether decode (t attending to its t + 1 cached keys, as when it was generated)
    gives the training forward's output bit for bit. Another request in the batch is further
    along, so the batch's gathered length exceeds t + 1."""
    q, k, v, g = random_qkv(6, seq, heads, groups, 32)
    expected = training_attention(q, k, v)
    k_cache, v_cache, table = paged_cache(k, v, g)
    matches = []
    for t in range(seq):
        lengths = torch.full((6,), t + 1, dtype=torch.int32)
        lengths[0] = seq
        out = paged_attention.flash_attn_with_kvcache(q[1:, t:t + 1], k_cache, v_cache, lengths[1:], table[1:],
                                                      max_seqlen_k=t + 1)
        matches.append(torch.equal(out[:, 0], expected[1:, t]))
    return matches


# (heads, groups): 2 query heads per key/value head (padded to MIN_GEMM_ROWS rows), 4, 5 (MKL sums
# 5-row GEMMs of the linear layers' shapes in another order; not SDPA's), and plain multi-head
# attention. Sequence lengths are multiples of 16, the CPU kernel's vector width (see the note in
# paged_attention.py).
@pytest.mark.parametrize("heads,groups,seq", [(4, 2, 16), (8, 2, 48), (10, 2, 32), (4, 4, 32)])
def test_decode_equals_training_attention_bitwise(heads, groups, seq):
    assert decode_matches_training(heads, groups, seq) == [True] * seq


def test_decode_needs_min_gemm_rows(monkeypatch):
    """Without padding the query rows, 2 heads per key/value head do not give the training forward's
    numbers (MKL sums a GEMM with fewer than 4 rows in another order)."""
    monkeypatch.setattr(paged_attention, "MIN_GEMM_ROWS", 1)
    assert not all(decode_matches_training(4, 2, 16)), "MIN_GEMM_ROWS is not needed any more"


def prefill_matches_training(lengths: list[int], seq: int = 0, seed: int = 0) -> list[bool]:
    """Per request: whether prefilling packed prompts of these lengths, each with its own cache blocks,
    gives the outputs of the training forward (of seq tokens; default the longest prompt) bit for bit."""
    q, k, v, g = random_qkv(len(lengths), seq or max(lengths), 8, 2, 32, seed=seed)
    expected = training_attention(q, k, v)
    k_cache, v_cache, table = paged_cache(k, v, g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = torch.cat([q[i, :n] for i, n in enumerate(lengths)])
    out = paged_attention.flash_attn_varlen_func(packed, k_cache, v_cache, cu, cu, max(lengths), max(lengths),
                                                 block_table=table)
    return [torch.equal(out[cu[i]:cu[i + 1]], expected[i, :n]) for i, n in enumerate(lengths)]


def test_prefill_equals_training_attention_bitwise():
    assert prefill_matches_training([48, 5, 33, 16]) == [True] * 4


def test_long_sequences_attend_over_the_training_length(monkeypatch):
    """Beyond attention.ONE_PASS_KEYS keys, torch's CPU kernel sums a token's attention in an order
    that depends on the key count: decode and prefill then run over exactly the training forward's
    length (attention.training_keys), whatever each request's own length, and agree bit for bit."""
    from megatron_rl.platform import attention

    seq = 288
    monkeypatch.setattr(attention, "training_keys", seq)
    assert decode_matches_training(8, 2, seq) == [True] * seq
    assert prefill_matches_training([seq, 5, 200, 150], seed=1) == [True] * 4
    assert prefill_matches_training([230, 5, 200, 150], seq, seed=1) == [True] * 4
    monkeypatch.setattr(attention, "training_keys", 0)  # attention over each request's own blocks
    assert not all(decode_matches_training(8, 2, seq)), "long sequences need no fixed key count any more"
    assert not all(prefill_matches_training([230, 5, 200, 150], seq, seed=1))
