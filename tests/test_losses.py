"""Advantage and loss functions against values computed by hand from their formulas."""

import math

import pytest
import torch

from megatron_rl import losses


def test_group_advantages_mean_baseline_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = losses.group_advantages(rewards, group_size=4, baseline="mean", std="group", eps=0.0 + 1e-12)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]: mean 0.5, squared deviations 4 x 0.25 -> 1/3
    assert adv[:4].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # all-equal rewards: no signal, no NaN


def test_group_advantages_leave_one_out_and_batch_std():
    rewards = torch.tensor([3.0, 0.0, 0.0, 1.0])  # two groups of 2
    loo = losses.group_advantages(rewards, 2, baseline="loo", std="none")
    assert loo.tolist() == [3.0, -3.0, -1.0, 1.0]  # r_i - (sum - r_i) / (G - 1)
    batch = losses.group_advantages(rewards, 2, baseline="mean", std="batch", eps=0.0)
    std = torch.tensor([3.0, 0.0, 0.0, 1.0]).std().item()
    assert batch.tolist() == pytest.approx([1.5 / std, -1.5 / std, -0.5 / std, 0.5 / std])
    with pytest.raises(ValueError, match="unknown advantage baseline"):
        losses.group_advantages(rewards, 2, baseline="median")


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    d = -0.5  # log(p_ref / p)
    assert losses.kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert losses.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert losses.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(d) - d - 1)
    assert losses.kl_penalty(ref, ref, "k3").item() == 0.0


@pytest.mark.parametrize("ratio, adv, expected_loss, expected_clipped", [
    (1.1, 1.0, -1.1, False),    # inside the range
    (1.5, 1.0, -1.2, True),     # positive advantage: capped at 1 + eps_high
    (0.5, 1.0, -0.5, False),    # positive advantage, ratio below: unclipped term is smaller
    (0.5, -1.0, 0.8, True),     # negative advantage: capped at 1 - eps_low
    (1.5, -1.0, 1.5, False),    # negative advantage, ratio above: no cap (the pessimistic bound)
    (1.2, 1.0, -1.2, False),    # exactly at the boundary: both terms equal, not counted as clipped
    (0.8, -1.0, 0.8, False),    # negative advantage exactly at the lower boundary: still learns
])
def test_clipped_policy_loss_by_hand(ratio, adv, expected_loss, expected_clipped):
    old = torch.tensor([[0.0]])
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, clipped = losses.clipped_policy_loss(logp, old, torch.tensor([adv]), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert clipped.item() == expected_clipped
    loss.sum().backward()
    # d/dlogp of -ratio * A is -ratio * A where the unclipped term is active, 0 where clipped
    assert logp.grad.item() == pytest.approx(0.0 if expected_clipped else -ratio * adv, abs=1e-6)


def test_loss_sums_over_microbatches_equal_the_full_batch():
    """Token-level normalization by the global count: splitting the batch does not change the loss."""
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(8, 5, generator=g) * 0.1, torch.randn(8, 5, generator=g) * 0.1
    mask = (torch.rand(8, 5, generator=g) > 0.3).float()
    adv = torch.randn(8, generator=g)
    per_token, _ = losses.clipped_policy_loss(logp, old, adv)
    full = losses.masked_sum(per_token, mask) / mask.sum()
    parts = sum(losses.masked_sum(per_token[i:i + 2], mask[i:i + 2]) for i in range(0, 8, 2)) / mask.sum()
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


# --- the GRPO family ------------------------------------------------------------------------------


def test_clip_higher_and_dual_clip_by_hand():
    old = torch.zeros(1, 1)
    # clip-higher: A > 0 capped at 1 + 0.28, not 1.2
    loss, clipped = losses.clipped_policy_loss(torch.tensor([[math.log(1.5)]]), old, torch.tensor([1.0]), 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.28) and clipped.item()
    # dual clip, A < 0, r = 4: PPO's objective min(-4, -1.2) = -4 is floored at c A = -3
    logp = torch.tensor([[math.log(4.0)]], requires_grad=True)
    loss, clipped = losses.clipped_policy_loss(logp, old, torch.tensor([-1.0]), 0.2, 0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0) and clipped.item()
    loss.sum().backward()
    assert logp.grad.item() == 0.0
    # below the dual-clip bound nothing changes: r = 2 gives -2 > -3
    loss, clipped = losses.clipped_policy_loss(torch.tensor([[math.log(2.0)]]), old, torch.tensor([-1.0]), 0.2, 0.2, 3.0)
    assert loss.item() == pytest.approx(2.0) and not clipped.item()


def test_gspo_sequence_ratio_by_hand():
    old = torch.zeros(3, 3)
    logp = torch.tensor([[0.1, -0.3, 9.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # third: fully masked
    adv = torch.tensor([1.0, 1.0, 1.0])
    per_token, clipped = losses.gspo_policy_loss(logp, old, adv, mask, 0.2, 0.2)
    seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # each sequence's loss
    s0 = math.exp((0.1 - 0.3) / 2)  # geometric mean of the token ratios; the masked 9.0 is ignored
    assert seq[0].item() == pytest.approx(-s0)
    assert seq[1].item() == pytest.approx(-1.2)  # s = e^0.5 = 1.65 clipped to 1.2
    assert seq[2].item() == 0.0 and not torch.isnan(per_token).any()
    assert clipped[1].all() and not clipped[0].any()
    num, den = losses.aggregate(per_token, mask, "sequence")
    assert (num / den).item() == pytest.approx((-s0 - 1.2) / 2)  # GSPO: the mean over sequences
    seq.sum().backward()
    # d(-s A)/d logp_t = -s A / |y| through the mean; zero where clipped
    assert logp.grad[0, :2].tolist() == pytest.approx([-s0 / 2, -s0 / 2])
    assert logp.grad[1].abs().sum().item() == 0.0


def test_cispo_keeps_gradient_of_clipped_tokens():
    logp = torch.tensor([[math.log(1.5), math.log(0.9)]], requires_grad=True)
    loss, clipped = losses.cispo_policy_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), 1.0, 0.2)
    # -sg(clip(r)) A log p: weights 1.2 (clipped from 1.5) and 0.9
    assert loss[0].tolist() == pytest.approx([-1.2 * 2 * math.log(1.5), -0.9 * 2 * math.log(0.9)])
    assert clipped[0].tolist() == [True, False]
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.4, -1.8])  # the clipped token still learns


def test_cispo_defaults_have_no_lower_bound_and_trls_cap():
    """policy_loss=cispo without clip settings: weights are not floored (MiniMax-M1) and capped at 5
    (TRL's CISPO epsilon_high=5.0); ppo keeps 0.2/0.2, and a setting the user made stays."""
    from megatron_rl.training.policy import clipped_loss
    from megatron_rl.config import AlgorithmConfig

    a = AlgorithmConfig(name="grpo", policy_loss="cispo")
    assert a.clip_range() == (1.0, 4.0)
    assert AlgorithmConfig(name="grpo").clip_range() == (0.2, 0.2)
    assert AlgorithmConfig(name="grpo", policy_loss="cispo", clip_high=0.28).clip_range() == (1.0, 0.28)
    logp = torch.tensor([[math.log(0.1), math.log(9.0)]])
    loss, clipped = clipped_loss(a, logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    assert loss[0].tolist() == pytest.approx([-0.1 * math.log(0.1), -5.0 * math.log(9.0)])
    assert clipped[0].tolist() == [False, True]


def test_loss_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    num, den = losses.aggregate(loss, mask, "token")
    assert (num / den).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    num, den = losses.aggregate(loss, mask, "sequence")  # the empty sequence does not count
    assert (num / den).item() == pytest.approx((2.0 + 4.0) / 2)
    num, den = losses.aggregate(loss, mask, "constant", max_len=5)
    assert (num / den).item() == pytest.approx(10 / (2 * 5))
    # numerators and denominators add up over microbatches
    parts = [losses.aggregate(loss[i:i + 1], mask[i:i + 1], "sequence") for i in range(3)]
    assert (sum(p[0] for p in parts) / sum(p[1] for p in parts)).item() == pytest.approx(3.0)
    # and over context-parallel ranks that each hold some of every sequence's tokens, given the
    # whole sequences' token counts, with one rank counting the sequences
    for mode in ("token", "sequence", "constant"):
        whole = losses.aggregate(loss, mask, mode, max_len=5)
        shares = [losses.aggregate(loss[:, cols], mask[:, cols], mode, max_len=5, seq_tokens=mask.sum(dim=1),
                                   count_sequences=rank == 0) for rank, cols in enumerate(([0, 2], [1]))]
        assert sum(p[0] for p in shares).item() == pytest.approx(whole[0].item()), mode
        assert sum(p[1] for p in shares).item() == whole[1].item(), mode


def test_mismatch_weights_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.125]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.5]]))  # token weights p_train / p_rollout: 2, 1, 0.25
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w, masked = losses.mismatch_weights(old, rollout, mask, "token_truncate", 1.5)
    assert w[0].tolist() == pytest.approx([1.5, 1.0, 0.25]) and not masked.any()
    w, masked = losses.mismatch_weights(old, rollout, mask, "token_mask", 3.0)
    assert w[0].tolist() == pytest.approx([2.0, 1.0, 0.0]) and masked[0].tolist() == [False, False, True]
    w, masked = losses.mismatch_weights(old, rollout, mask, "sequence_truncate", 10.0)
    assert w[0].tolist() == pytest.approx([0.5, 0.5, 0.5])  # 2 x 1 x 0.25
    w, masked = losses.mismatch_weights(old, rollout, mask, "sequence_mask", 1.5)
    assert w.sum().item() == 0.0 and masked.all()


def test_overlong_penalty_by_hand():
    pen = losses.overlong_penalty(torch.tensor([5, 6, 8, 10, 12]), max_len=10, buffer=4, penalty=1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_gdpo_normalizes_each_component_in_its_group():
    # two groups of 2; components: correctness (0/1) and a small format score
    comps = torch.tensor([[1.0, 0.2], [0.0, 0.1], [1.0, 0.5], [1.0, 0.1]])
    adv = losses.gdpo_advantages(comps, torch.tensor([1.0, 0.5]), group_size=2, eps=0.0 + 1e-12)
    s = math.sqrt(0.5)  # std of any two distinct values x, y is |x - y| / sqrt(2)
    g1 = [0.5 / s + 0.5 * (0.05 / (0.1 * s)), -0.5 / s - 0.5 * (0.05 / (0.1 * s))]
    g2 = [0.0 + 0.5 * (0.2 / (0.4 * s)), 0.0 - 0.5 * (0.2 / (0.4 * s))]  # equal correctness: 0, no NaN
    total = torch.tensor(g1 + g2, dtype=torch.float64)
    expected = (total - total.mean()) / total.std()
    assert adv.tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert losses.informative_groups(rewards, 2).tolist() == [False, True, False]


# --- preferences ---------------------------------------------------------------------------------


def _sig(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("kind, smoothing", [("sigmoid", 0.0), ("cdpo", 0.1), ("robust", 0.1), ("ipo", 0.0),
                                             ("hinge", 0.0)])
def test_preference_losses_and_their_gradients(kind, smoothing):
    """Each DPO-family loss and its derivative in x = delta_c - delta_r, from the formulas by hand."""
    beta = 0.5
    chosen = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.1, 1.0, 0.0], dtype=torch.float64, requires_grad=True)
    loss = losses.preference_loss(chosen, rejected, beta, kind, smoothing)
    loss.sum().backward()
    for i, x in enumerate((0.2, -2.0, 2.0)):
        if kind in ("sigmoid", "cdpo"):  # -(1-e) log s(bx) - e log s(-bx); d/dx = -(1-e) b s(-bx) + e b s(bx)
            value = -(1 - smoothing) * math.log(_sig(beta * x)) - smoothing * math.log(_sig(-beta * x))
            slope = -(1 - smoothing) * beta * _sig(-beta * x) + smoothing * beta * _sig(beta * x)
        elif kind == "robust":  # (-(1-e) log s(bx) + e log s(-bx)) / (1-2e)
            value = (-(1 - smoothing) * math.log(_sig(beta * x)) + smoothing * math.log(_sig(-beta * x))) / (1 - 2 * smoothing)
            slope = (-(1 - smoothing) * beta * _sig(-beta * x) - smoothing * beta * _sig(beta * x)) / (1 - 2 * smoothing)
        elif kind == "ipo":  # (x - 1/(2b))^2
            value, slope = (x - 1 / (2 * beta)) ** 2, 2 * (x - 1 / (2 * beta))
        else:  # max(0, 1 - b x)
            value, slope = max(0.0, 1 - beta * x), (-beta if 1 - beta * x > 0 else 0.0)
        assert loss[i].item() == pytest.approx(value, rel=1e-12)
        assert chosen.grad[i].item() == pytest.approx(slope, rel=1e-12)
        assert rejected.grad[i].item() == pytest.approx(-slope, rel=1e-12)


def test_dpo_loss_is_ln2_when_the_policy_is_the_reference():
    zero = torch.zeros(4)
    assert losses.preference_loss(zero, zero, 0.1).tolist() == pytest.approx([math.log(2)] * 4, abs=1e-7)
    with pytest.raises(ValueError, match="unknown preference loss"):
        losses.preference_loss(zero, zero, 0.1, "exo_pair")


def test_bradley_terry_with_margin_and_centering():
    rc = torch.tensor([1.0, -0.5], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.0, 0.5], dtype=torch.float64, requires_grad=True)
    margin = torch.tensor([0.5, 0.0], dtype=torch.float64)
    loss = losses.bradley_terry_loss(rc, rr, margin, center_coefficient=0.01)
    loss.sum().backward()
    # pair 0: d = 1 - 0 - 0.5 = 0.5; pair 1: d = -1. Centering adds 0.01 (rc + rr)^2.
    assert loss.tolist() == pytest.approx([-math.log(_sig(0.5)) + 0.01 * 1.0, -math.log(_sig(-1.0)) + 0.0])
    assert rc.grad.tolist() == pytest.approx([-_sig(-0.5) + 0.02 * 1.0, -_sig(1.0) + 0.0])
    assert rr.grad.tolist() == pytest.approx([_sig(-0.5) + 0.02 * 1.0, _sig(1.0) + 0.0])
    plain = losses.bradley_terry_loss(rc.detach(), rr.detach())
    assert plain.tolist() == pytest.approx([-math.log(_sig(1.0)), -math.log(_sig(-1.0))])


def test_rloo_is_the_leave_one_out_baseline_without_scaling():
    """RLOO: A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - group mean)."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    adv = losses.group_advantages(r, 3, "loo", "none")
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5, -1.0, 2.0, -1.0])
    mean = r.reshape(2, 3).mean(1, keepdim=True)
    assert adv.tolist() == pytest.approx((1.5 * (r.reshape(2, 3) - mean)).reshape(-1).tolist())


def test_reinforce_pp_by_hand():
    """Reward minus group mean on every response token, minus kl_coef x the token's KL, whitened over
    the valid tokens of the batch; padding gets 0."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.2, 0.0, 9.0], [0.0, 0.0, 9.0], [0.1, 0.1, 0.1], [0.0, 0.4, 9.0]])
    adv = losses.reinforce_pp_advantages(r, 2, mask, kl, kl_coef=0.5)
    raw = [[0.4, 0.5], [-0.5], [-0.05, -0.05, -0.05], [0.0, -0.2]]  # (r - group mean) - 0.5 kl
    flat = [v for row in raw for v in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / len(flat))
    expected = [[(v - mean) / std for v in row] + [0.0] * (3 - len(row)) for row in raw]
    assert adv.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


def _as_rank(fn, mine, other):
    """fn on this rank's half of a batch, its reduce adding what the other rank's half contributes (as
    dp_sum does over the data-parallel group): the other half's moment vectors, call by call."""
    recorded = []
    fn(other, lambda t: recorded.append(t) or t)
    calls = iter(recorded)
    return fn(mine, lambda t: t + next(calls))


def test_batch_statistics_span_every_data_parallel_rank():
    """std_normalization=batch, GDPO, REINFORCE++ and PPO's whitening normalize over the global batch:
    two ranks holding half of it each compute the full batch's advantages, which their local statistics
    would not."""
    torch.manual_seed(0)
    rewards, components, mask = torch.rand(16), torch.rand(16, 2), (torch.rand(16, 5) > 0.3).float()
    tokens = torch.rand(16, 5) + torch.arange(16.0)[:, None]  # its halves have different means
    cases = [(lambda x, reduce: losses.group_advantages(x, 4, "mean", "batch", reduce=reduce), rewards),
             (lambda x, reduce: losses.gdpo_advantages(x, torch.tensor([1.0, 0.5]), 4, reduce=reduce), components),
             (lambda x, reduce: losses.reinforce_pp_advantages(x[0], 4, x[1], reduce=reduce), (rewards, mask)),
             (lambda x, reduce: losses.whiten(x[0], x[1], reduce=reduce), (tokens, mask))]
    for fn, batch in cases:
        halves = list(zip(*(x.chunk(2) for x in batch))) if isinstance(batch, tuple) else list(batch.chunk(2))
        full = fn(batch, lambda t: t)
        joined = torch.cat([_as_rank(fn, halves[0], halves[1]), _as_rank(fn, halves[1], halves[0])])
        assert torch.allclose(joined, full, atol=1e-6)
        local = torch.cat([fn(h, lambda t: t) for h in halves])
        assert not torch.allclose(local, full, atol=1e-3)  # what each rank alone would have computed

