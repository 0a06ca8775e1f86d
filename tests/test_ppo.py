"""PPO with a critic: per-token rewards, GAE and the clipped value loss against hand-computed values,
values aligned with the tokens they chose, the critic's and the policy's updates equal at every
layout and microbatching, and learning (tests/test_grpo_family.py: tiny_ppo)."""

import pytest
import torch

from megatron_rl import losses
from tests.helpers import column, processes, run_train

pytestmark = [pytest.mark.xdist_group("tiny_sft"),  # the policy and the critic start from the shared tiny_sft run
              pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")]


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    kl = torch.tensor([[9.0, 0.1, 0.2, 0.3, 9.0], [9.0, 9.0, 0.4, 9.0, 9.0]])
    r = losses.token_rewards(torch.tensor([1.0, 0.5]), mask, kl, kl_coef=0.5)
    assert r.tolist() == [pytest.approx([0, -0.05, -0.1, 1 - 0.15, 0]), pytest.approx([0, 0, 0.5 - 0.2, 0, 0])]


def test_gae_against_hand_computed_values():
    """delta_t = r_t + gamma V_{t+1} - V_t (V after the last response token 0), A_t = delta_t +
    gamma lam A_{t+1}, R_t = A_t + V_t; prompt and padding positions get 0."""
    gamma, lam = 0.9, 0.8
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    r = torch.tensor([[0.0, 0.1, -0.2, 1.0, 0.0]])
    v = torch.tensor([[7.0, 0.5, 0.3, 0.6, 7.0]])
    d3 = 1.0 - 0.6
    d2 = -0.2 + gamma * 0.6 - 0.3
    d1 = 0.1 + gamma * 0.3 - 0.5
    a3 = d3
    a2 = d2 + gamma * lam * a3
    a1 = d1 + gamma * lam * a2
    adv, ret = losses.gae(r, v, mask, gamma, lam)
    assert adv.tolist() == [pytest.approx([0, a1, a2, a3, 0])]
    assert ret.tolist() == [pytest.approx([0, a1 + 0.5, a2 + 0.3, a3 + 0.6, 0])]
    # lam = 1, gamma = 1: the return is the sum of the rewards to go, whatever the values
    _, ret = losses.gae(r, v, mask, 1.0, 1.0)
    assert ret.tolist() == [pytest.approx([0, 0.9, 0.8, 1.0, 0])]
    # A multi-turn episode's observation tokens (mask 0 inside the response) are skipped, not ends: the
    # same advantages on the model's tokens as with the observation cut out
    gap = torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    adv_gap, ret_gap = losses.gae(torch.tensor([[0.0, 0.1, 5.0, 5.0, -0.2, 1.0, 0.0]]),
                                  torch.tensor([[7.0, 0.5, 9.0, 9.0, 0.3, 0.6, 7.0]]), gap, gamma, lam)
    assert adv_gap.tolist() == [pytest.approx([0, a1, 0, 0, a2, a3, 0])]
    assert ret_gap.tolist() == [pytest.approx([0, a1 + 0.5, 0, 0, a2 + 0.3, a3 + 0.6, 0])]


def test_clipped_value_loss_by_hand():
    v, old, ret = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.0, 0.0, 0.4]), torch.tensor([0.0, 1.0, 0.5])
    loss, clipped = losses.value_loss(v, old, ret, clip=0.2)
    # 1: max((1-0)^2, (0.2-0)^2) = 1, unclipped; 2: max((0-1)^2, (0-1)^2) = 1; 3: max(0, (0.5-0.5)^2) = 0
    assert loss.tolist() == pytest.approx([0.5, 0.5, 0.0]) and clipped.tolist() == [False, False, False]
    loss, clipped = losses.value_loss(torch.tensor([0.0]), torch.tensor([0.5]), torch.tensor([0.1]), clip=0.2)
    assert loss.tolist() == pytest.approx([0.5 * 0.2**2]) and clipped.tolist() == [True]  # clip(0) = 0.3


def test_values_are_those_of_the_state_that_chose_each_token(one_process):
    """The value at a response token is the critic's output at the position whose label is that token:
    the first response token's value is the critic's value of the prompt alone (a one-token shift
    would give the value after the token), and no value depends on the tokens after its position."""
    from megatron_rl.config import Config
    from megatron_rl.data import rl as rl_data
    from megatron_rl.training.critic import values_of
    from megatron_rl.training.setup import build_model

    cfg = Config()
    cfg.model.vocab_size, cfg.model.head, cfg.model.init_method_std = 16, "score", 0.3
    cfg.data.seq_length, cfg.data.micro_batch_size = 8, 2
    chunks, _ = build_model(cfg, wrap_ddp=False)
    prompts, completions = [[1, 5, 6], [1, 7]], [[3, 4, 2], [9, 9, 9, 2]]
    batch = {**rl_data.pack(prompts, completions, 8, 0), "index": torch.arange(2)}
    values = values_of(chunks, batch, cfg)
    first = batch["loss_mask"].argmax(dim=1)  # each row's first response token
    alone = values_of(chunks, {**rl_data.pack(prompts, [[0], [0]], 8, 0), "index": torch.arange(2)}, cfg)
    for i, p in enumerate(prompts):
        assert first[i] == len(p) - 1 and values[i, first[i]] == pytest.approx(alone[i, len(p) - 1].item(), abs=1e-6)
    changed = batch["tokens"].clone()
    changed[:, 4:] = 11
    after = values_of(chunks, {**batch, "tokens": changed}, cfg)
    assert torch.allclose(after[:, :4], values[:, :4], atol=1e-6) and not torch.allclose(after[:, 4], values[:, 4])


QUICK = ["train.eval_every=0", "logging.progress=false", "logging.tensorboard=false", "checkpoint.save=false",
         "data.num_val=16", "data.num_train=2000", "train.max_steps=2", "algorithm.prompts_per_step=16", "rollout.n=4",
         "data.micro_batch_size=8", "rollout.top_k=1", "algorithm.kl_coef=0.05", "algorithm.minibatches=2",
         "ppo.value_clip=0.01", "ppo.critic_warmup_steps=1"]
COMPARED = ["train/value_loss", "train/critic_grad_norm", "train/explained_variance", "train/value_clip_frac",
            "train/loss", "train/grad_norm", "train/kl"]


@pytest.fixture(scope="module")
def sft_checkpoint(sft_run):
    from megatron_rl.checkpointing import checkpoint_dir

    return checkpoint_dir(sft_run, 2000)


def _ppo(sft_checkpoint, run_dir, *extra, nproc=1):
    run_train(["--recipe", "tiny_ppo", *QUICK, f"checkpoint.load={sft_checkpoint}", *extra, f"logging.run_dir={run_dir}"],
              nproc=nproc)


@pytest.fixture(scope="module")
def single(sft_checkpoint, tmp_path_factory):
    run = tmp_path_factory.mktemp("ppo_single")
    _ppo(sft_checkpoint, run)
    return run


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"], ["parallel.dp=2"], ["parallel.cp=2"],
                                    ["data.micro_batch_size=4"]], ids=["tp2", "pp2", "dp2", "cp2", "micro4"])
def test_ppo_layouts_match_single_process(layout, single, sft_checkpoint, tmp_path):
    """The same samples, values, GAE, and the same critic and policy losses and gradient norms at every
    layout and microbatch size (both losses are means over the global batch's tokens). Step 1 trains
    the critic alone (warm-up), step 2 both; two minibatches each (the same samples at every DP size), the
    second clipping some values (a tight ppo.value_clip)."""
    _ppo(sft_checkpoint, tmp_path, *layout, nproc=processes(layout))
    assert column(tmp_path, "rollout/response_len_mean") == column(single, "rollout/response_len_mean")
    for key in COMPARED:  # explained variance (0.025 at step 2) is a difference of near-equal variances
        close = dict(rel=1e-5, abs=1e-6 if key == "train/explained_variance" else 1e-7)  # TP2: 2.6e-7 apart on one CPU
        assert column(tmp_path, key) == pytest.approx(column(single, key), **close), key
    assert max(column(single, "train/value_clip_frac")) > 0
    assert len(column(single, "train/value_loss")) == 2 and len(column(single, "train/grad_norm")) == 1  # warm-up
