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
