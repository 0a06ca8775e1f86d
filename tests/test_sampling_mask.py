"""Top-p / top-k that trains on what it sampled: the sampler records each token's kept set (its threshold
logit and size) and the token's log-prob under the kept set, renormalized; training replays that kept set.
Rollout and training logprobs then agree as closely as without a filter, where the full distribution's
would not; the mean importance ratio against the sampler is 1 with the replay and the kept mass without."""

import pytest
import torch

from tests.helpers import PROMPTS, device, random_char_engine

pytestmark = pytest.mark.fp32("rollout/training equalities at fp32 precision")


def _replayed(chunk, vocab: int, out) -> list[tuple]:
    """Per sample: (rollout logprobs, the training forward's with the kept set replayed, its full
    distribution's, the kept set's size in training), each (T,)."""
    from megatron_rl.training.logprobs import kept_size, mask_padded_vocab, token_logprobs

    rows = []
    for prompt, completion, *per_token in zip(out.prompts, out.completions, out.logprobs, out.thresholds, out.kept):
        t = torch.tensor([prompt + completion], device=device())
        with torch.no_grad():
            logits = chunk(t, torch.arange(t.shape[1], device=t.device)[None], None)[:, len(prompt) - 1:-1].float()
        logits = mask_padded_vocab(logits, vocab)
        labels, threshold = torch.tensor([completion]), torch.tensor([per_token[1]])
        rows.append((torch.tensor(per_token[0]), token_logprobs(logits, labels, threshold)[0],
                     token_logprobs(logits.clone(), labels)[0], kept_size(logits, threshold)[0],
                     torch.tensor(per_token[2], dtype=torch.float)))
    return rows


@pytest.mark.parametrize("sampling", [{"top_p": 0.8}, {"top_k": 8}], ids=["top_p=0.8", "top_k=8"])
def test_training_replays_the_samplers_kept_set(one_process, tmp_path, sampling):
    tok, chunks, engine = random_char_engine(tmp_path, max_new_tokens=8)
    for key, value in sampling.items():
        setattr(engine.cfg, key, value)
    out = engine.generate(PROMPTS, n=16, seed=1)
    assert len(out.thresholds) == len(out.completions) and all(len(t) == len(c) for t, c in zip(out.thresholds, out.completions))
    rows = _replayed(chunks[0], len(tok), out)
    rollout, replayed, full, size, recorded = (torch.cat(x) for x in zip(*rows))
    # the replayed kept set is the sampler's: the same size for every token, the same logprobs within fp32
    assert torch.equal(size, recorded)
    if "top_k" in sampling:
        assert (recorded >= 8).all() and (recorded == 8).float().mean() > 0.9  # ties at the cut are kept
    assert (recorded < len(tok)).float().mean() > 0.5  # the filter did cut
    # as close as the full distribution's logprobs of rollout and training (this random model's logits
    # are large: about 1e-5 apart, measured up to 2e-5 either way, by the thread count)
    own = (torch.cat([torch.tensor(u) for u in out.full_logprobs]) - full).abs().max()
    assert (rollout - replayed).abs().max() <= min(own + 2e-6, 5e-5)
    # the full distribution's logprobs are not the sampler's: their gap is minus the log of the kept mass
    assert (rollout - full).abs().max() > 1e-3  # 0.22 (top_p=0.8), 0.079 (top_k=8) here
    assert torch.allclose(rollout - full, torch.tensor([x for f, u in zip(out.logprobs, out.full_logprobs)
                                                        for x in torch.tensor(f) - torch.tensor(u)]), atol=3e-5)
    # the importance ratio against the sampler, in expectation over its draws: 1 with the kept set
    # replayed; the kept mass (below 1) against the full distribution (TRL measured 0.896 at top_p=0.8)
    assert (replayed - rollout).exp().mean().item() == pytest.approx(1.0, abs=1e-5)
    ratio = (full - rollout).exp().mean().item()
    assert ratio < (0.95 if "top_p" in sampling else 0.999), ratio  # 0.9, 0.99 here


def test_replayed_tokens_outside_the_kept_set_get_no_gradient(one_process):
    """Below the threshold (the label excepted, kept even a rounding below it) logits are -inf: their
    gradient is 0, and the kept set's gradient is the renormalized softmax's."""
    from megatron_rl.training.logprobs import token_logprobs

    logits = torch.tensor([[[3.0, 1.0, 2.0, 0.5, 2.0]]], requires_grad=True)
    threshold = torch.tensor([[2.0]])  # keeps 3, 2, 2 (a tie at the cut)
    for label, kept in ((0, [0, 2, 4]), (3, [0, 2, 3, 4])):  # label 3 lies below the cut: kept anyway
        logits.grad = None
        logp = token_logprobs(logits, torch.tensor([[label]]), threshold)
        logp.sum().backward()
        sub = logits.detach()[0, 0, kept]
        assert logp.item() == pytest.approx((sub.log_softmax(-1)[kept.index(label)]).item(), abs=1e-6)
        outside = [v for v in range(5) if v not in kept]
        assert (logits.grad[0, 0, outside] == 0).all() and (logits.grad[0, 0, kept] != 0).all()


def test_sampling_threshold_ties_and_nucleus():
    """top-p keeps the smallest most-likely prefix reaching p (at the sampling temperature), and every token
    tied with its last; top-k the k largest and their ties; the threshold lies midway to the next lower
    logit (-inf where none is dropped)."""
    from megatron_rl.rollout.engine import sampling_threshold

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.2, 0.2, 0.2]]))

    def kept(t=1.0, k=0, p=0.0):
        return (logits >= sampling_threshold(logits, t, k, p)[:, None]).sum(-1).tolist()

    assert kept(p=0.7) == [2, 4] and kept(p=0.9) == [3, 4] and kept(p=0.4) == [1, 1] and kept(k=2) == [2, 4]
    assert kept(p=0.6) == [2, 4] and kept(t=0.5, p=0.6) == [1, 4]  # at 0.5 the first token has 0.685 of the mass
    assert sampling_threshold(logits, 1.0, 0, 0.7)[0].item() == pytest.approx(logits[0, 1:3].mean().item())
    assert sampling_threshold(logits, 1.0, 0, 0.7)[1].isneginf() and sampling_threshold(logits, 1.0, 0, 0.0).isneginf().all()
