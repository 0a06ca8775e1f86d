"""Multi-turn episodes: token ids kept as generated with the environment's observations between turns,
masked out of the loss; rollout log-probs of every turn equal the training forward's; budgets, turn
limits and truncation; GRPO on episodes end to end."""

import pytest
import torch

from megatron_rl.checkpointing import checkpoint_dir
from megatron_rl.environments import Environment, EnvRunner, Turn, last_of
from tests.helpers import metrics, random_char_engine, run_train


class Relay(Environment):
    """Answers every turn that ends on a stop string (an odd digit) with '+1=' until the fifth turn; one
    point per turn. A turn ending otherwise (eos, or the token budget) ends the episode."""

    stop = ["1", "3", "5", "7", "9"]

    def __init__(self, cfg=None):
        pass

    def step_one(self, conversation, metadata):
        turns = sum(m["role"] == "assistant" for m in conversation)
        more = last_of(conversation, "assistant").endswith(tuple(self.stop)) and turns < 5
        return Turn(reward=1.0, done=not more, observation="+1=" if more else "", answer=str(turns))


def test_episode_tokens_masks_and_logprobs_match_a_training_forward(one_process, tmp_path):
    from megatron_rl.rollout.episodes import run_episodes

    tok, chunks, engine = random_char_engine(tmp_path, max_new_tokens=6)
    prompts = [[tok.bos_token_id, 3, 4, 11], [tok.bos_token_id, 5, 12]]
    runner = EnvRunner(Relay())
    budget = 16
    out = run_episodes(engine, runner, tok, prompts, [{}, {}], n=16, seed=1, max_turns=3, budget=budget)
    runner.close()
    r = out.rollout
    observation = tok("+1=", add_special_tokens=False)["input_ids"]
    assert out.stats["rollout/turns_max"] == 3 and out.stats["rollout/observation_tokens_mean"] > 0
    assert sum(out.stats[f"rollout/{e}_frac"] for e in ("done", "truncated", "max_turns")) == pytest.approx(1)
    assert any(r.truncated) and out.stats["rollout/max_turns_frac"] > 0 and out.failures == 0
    for i, (ids, mask, logp) in enumerate(zip(r.completions, r.masks, r.logprobs)):
        prompt = prompts[i // 16]
        assert len(ids) == len(mask) == len(logp) and len(prompt) + len(ids) <= budget
        # the observation follows each turn that ended on the stop string, out of the loss
        spans, k = [], 0
        while k < len(ids):
            if mask[k] == 0:
                assert ids[k:k + 3] == observation and mask[k:k + 3] == [0, 0, 0] and logp[k:k + 3] == [0, 0, 0]
                assert tok.decode(ids[:k]).endswith(tuple(Relay.stop))
                spans.append(k)
                k += 3
            else:
                k += 1
        turns = len(spans) + 1
        assert out.rewards[i] == turns and out.answers[i] == str(turns)  # rewards add up over the turns
        # A fresh rendering of the conversation gives the same ids, with a character tokenizer, except the
        # special tokens the model generated (eos; this random model also samples pad and bos), which
        # decoding drops. With BPE a rendering can also split text differently: the turns are never
        # decoded and tokenized again.
        text = tok.decode(prompt + ids, skip_special_tokens=True)
        rendered = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        assert rendered == prompt[:1] + [t for t in prompt[1:] + ids if t not in tok.all_special_ids]
        # every generated token's rollout log-prob equals the training forward's
        tokens = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = chunks[0](tokens, torch.arange(tokens.shape[1])[None], None)
        trained = torch.log_softmax(logits.float()[0, len(prompt) - 1:-1, :len(tok)], -1)
        trained = trained.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        generated = torch.tensor(mask) > 0
        assert (trained[generated] - torch.tensor(logp)[generated]).abs().max() <= 1e-5


@pytest.mark.xdist_group("tiny_sft")  # starts from the shared tiny_sft run
def test_grpo_on_episodes(sft_run, tmp_path):
    """tiny_grpo with a three-turn environment: episodes train as one sequence each, the observations
    out of the loss; the mismatch bound holds over the generated tokens of every turn."""
    run = tmp_path / "run"
    run_train(["--recipe", "tiny_grpo", "train.max_steps=2", "train.eval_every=0", "logging.progress=false",
               "logging.tensorboard=false", "checkpoint.save=false", "data.num_val=32", "data.num_train=2000",
               "rewards.fn=tests.test_episodes:Relay", "rollout.max_turns=3", "rollout.max_new_tokens=4",
               f"checkpoint.load={checkpoint_dir(sft_run, 2000)}", f"logging.run_dir={run}"])
    rows = [m for m in metrics(run) if "rollout/turns_mean" in m]
    assert len(rows) == 2
    assert all(m["rollout/turns_max"] <= 3 and m["rollout/logprob_mismatch_max"] <= 1e-5 for m in rows)
    assert any(m["rollout/turns_mean"] > 1 and m["rollout/observation_tokens_mean"] > 0 for m in rows)
    assert rows[-1]["rollout/reward_mean"] == pytest.approx(rows[-1]["rollout/turns_mean"])
    assert "val/accuracy" in metrics(run)[-1]
