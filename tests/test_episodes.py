"""Multi-turn episodes: token ids kept as generated with the environment's observations between turns,
masked out of the loss; rollout log-probs of every turn equal the training forward's; budgets, turn
limits and truncation; GRPO on episodes end to end."""

import pytest
import torch

from megatron_rl.checkpointing import checkpoint_dir
from megatron_rl.environments import Environment, EnvRunner, Turn, last_of
from tests.helpers import metrics, random_char_engine, run_recipes, run_train

pytestmark = pytest.mark.fp32("rollout/training, layout and resume equalities at fp32 precision")


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


class ToolRelay(Relay):
    """Relay as a tool whose calls end on some letters too (the chat test's model writes mostly letters)."""

    role = "tool"
    stop = ["a", "o", "1", "3", "5"]


CHATML = ("{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
          "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")


def test_chat_observations_are_what_the_template_renders_between_turns(one_process, tmp_path):
    """rollout.observation_format=chat: each observation is the model's end-of-turn tokens, the
    observation as a 'tool' message and the generation prompt, as the chat template renders them; an
    episode's ids then equal a fresh rendering of its conversation, except that the rendering closes
    the model's last turn with the end-of-turn tokens (and drops special tokens the model generated
    inside a turn, which decoding skips: such episodes are left out of the comparison)."""
    from megatron_rl.rollout.episodes import observation_ids, run_episodes

    tok, chunks, engine = random_char_engine(tmp_path, max_new_tokens=6, alphabet="0123456789+=adeilmnorstu\n")
    tok.chat_template = CHATML
    engine.cfg.observation_format = "chat"
    delta = observation_ids(tok, "+1=", "chat", "tool")
    assert tok.decode(delta) == "<eos>\n<bos>tool\n+1=<eos>\n<bos>assistant\n"

    question = [{"role": "user", "content": "3+4="}]
    prompt = tok(tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    runner = EnvRunner(ToolRelay())
    out = run_episodes(engine, runner, tok, [prompt], [{}], n=48, seed=1, max_turns=3, budget=80)
    runner.close()
    compared = several = 0
    for ids, mask in zip(out.rollout.completions, out.rollout.masks):
        turns, k = [[]], 0
        while k < len(ids):
            if mask[k] == 0:
                assert ids[k:k + len(delta)] == delta and mask[k:k + len(delta)] == [0.0] * len(delta)
                turns.append([])
                k += len(delta)
            else:
                turns[-1].append(ids[k])
                k += 1
        if any(t in tok.all_special_ids for turn in turns for t in turn[:-1]) or turns[-1][-1:] in (
                [tok.pad_token_id], [tok.bos_token_id]):
            continue
        conversation = list(question)
        for i, turn in enumerate(turns):
            conversation.append({"role": "assistant", "content": tok.decode(turn, skip_special_tokens=True)})
            if i < len(turns) - 1:
                conversation.append({"role": "tool", "content": "+1="})
        fresh = tok(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)["input_ids"]
        closing = tok("<eos>\n", add_special_tokens=False)["input_ids"]
        episode = prompt + ids
        assert fresh == (episode + closing[1:] if episode[-1] == tok.eos_token_id else episode + closing)
        compared += 1
        several += len(turns) > 1
    assert compared >= 4 and several >= 2 and out.stats["rollout/turns_mean"] > 1 and out.failures == 0


@pytest.mark.parametrize("fixed_keys", [True, False], ids=["fixed", "own"])
def test_long_episodes_logprobs_match_training(one_process, tmp_path, monkeypatch, fixed_keys):
    """Episodes of 200-300 tokens, trained as rows of data.seq_length = 320: every turn's re-prefill
    and decode attend over the training length (megatron_rl/platform/attention.py ONE_PASS_KEYS), and the
    rollout log-probs agree with the training forward's within 2e-6 (measured 1.2e-6; single-turn
    rollouts get the same bound). Over each request's own keys instead they differ more (7.6e-6 here;
    1.3e-5 in a trained puzzle run at 288 tokens)."""
    from megatron_rl.rollout.episodes import run_episodes
    from megatron_rl.platform import attention

    seq = 320
    tok, chunks, engine = random_char_engine(tmp_path, max_new_tokens=12, seq_length=seq)
    if not fixed_keys:
        monkeypatch.setattr(attention, "ONE_PASS_KEYS", 10**6)
    g = torch.Generator().manual_seed(0)
    prompts = [[tok.bos_token_id] + torch.randint(3, 13, (190 + 7 * i,), generator=g).tolist() for i in range(3)]
    runner = EnvRunner(Relay())
    out = run_episodes(engine, runner, tok, prompts, [{}] * 3, n=4, seed=3, max_turns=5, budget=seq + 1)
    runner.close()
    r = out.rollout
    assert out.stats["rollout/turns_mean"] > 1.5
    worst = 0.0
    for i, (ids, mask, logp) in enumerate(zip(r.completions, r.masks, r.logprobs)):
        prompt = prompts[i // 4]
        tokens = torch.full((1, seq), tok.pad_token_id)  # the training row: data.seq_length tokens
        tokens[0, :len(prompt) + len(ids) - 1] = torch.tensor(prompt + ids[:-1])
        with torch.no_grad():
            logits = chunks[0](tokens, torch.arange(seq)[None], None)
        trained = torch.log_softmax(logits.float()[0, len(prompt) - 1:len(prompt) + len(ids) - 1, :len(tok)], -1)
        trained = trained.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        generated = torch.tensor(mask) > 0
        worst = max(worst, (trained[generated] - torch.tensor(logp)[generated]).abs().max().item())
    print(f"long episodes, {'training' if fixed_keys else 'own'} key count: worst mismatch {worst:.2e}")
    assert (worst <= 2e-6) if fixed_keys else (worst > 2e-6)


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


def test_moe_turns_route_earlier_tokens_as_recorded(one_process, tmp_path):
    """An MoE model's episode: each turn's prefill routes the tokens of earlier turns to the experts
    recorded when they were first fed (here forced to other experts than the router picks), and the
    turn's log-probs are those of a training forward replaying exactly those routes."""
    from megatron_rl.config import Config
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.training.routing import RoutingTape, pack_routes, routes_queued
    from megatron_rl.training.setup import build_model
    from recipes.tiny import tiny_moe_model

    tok = build_char_tokenizer("0123456789+=", tmp_path / "tok")
    cfg = Config()
    cfg.model = tiny_moe_model()
    cfg.model.vocab_size, cfg.model.init_method_std, cfg.data.seq_length = len(tok), 0.5, 40
    cfg.rollout.max_new_tokens = 8
    chunks, _ = build_model(cfg, wrap_ddp=False)
    engine = RolloutEngine(chunks, cfg.model, tok, cfg.rollout, torch.float32)
    tape = RoutingTape(chunks, cfg.model.moe_topk, False)
    prompt = [tok.bos_token_id, 3, 4, 11, 5, 12]
    first = engine.generate([prompt], seed=0, tape=tape)
    episode = prompt + first.completions[0]
    forced = (first.routes[0] + 1) % cfg.model.num_experts  # other experts for every token fed so far
    second = engine.generate([episode], seed=1, tape=tape, routes=[forced])
    routes = second.routes[0]
    assert torch.equal(routes[:len(forced)], forced) and (routes >= 0).all()
    ids = episode + second.completions[0]
    tokens = torch.full((1, cfg.data.seq_length), tok.pad_token_id)
    tokens[0, :len(ids) - 1] = torch.tensor(ids[:-1])
    mb = {"tokens": tokens, **pack_routes([routes], cfg.data.seq_length)}
    with torch.no_grad(), routes_queued(tape, [mb], replay=True):
        logits = chunks[0](tokens, torch.arange(cfg.data.seq_length)[None], None)
    generated = torch.tensor(second.completions[0])
    trained = torch.log_softmax(logits.float()[0, len(episode) - 1:len(ids) - 1, :len(tok)], -1)
    trained = trained.gather(-1, generated[:, None])[:, 0]
    assert (trained - torch.tensor(second.logprobs[0])).abs().max() <= 1e-5
    assert tape.take_counts()["replayed"] == len(tape.layers) * (len(ids) - 1)
    with torch.no_grad():  # the router's own choices give other log-probs: the forcing was real
        own = torch.log_softmax(chunks[0](tokens, torch.arange(cfg.data.seq_length)[None], None).float()[
            0, len(episode) - 1:len(ids) - 1, :len(tok)], -1).gather(-1, generated[:, None])[:, 0]
    assert (own - trained).abs().max() > 1e-3


def test_moe_grpo_on_episodes(tmp_path):
    """tiny_moe_grpo with a three-turn environment and router replay: every token fed to training is
    routed as the rollout routed it, and the log-prob mismatch bound holds over all turns."""
    run = tmp_path / "run"
    run_train(["--recipe", "tiny_moe_grpo", "train.max_steps=2", "train.eval_every=0", "logging.progress=false",
               "logging.tensorboard=false", "checkpoint.save=false", "checkpoint.load=", "data.num_val=16",
               "data.num_train=200", "algorithm.prompts_per_step=8", "rewards.fn=tests.test_episodes:Relay",
               "rollout.max_turns=3", "rollout.max_new_tokens=4", f"logging.run_dir={run}"])
    rows = [m for m in metrics(run) if "rollout/turns_mean" in m]
    assert len(rows) == 2 and any(m["rollout/turns_mean"] > 1 for m in rows)
    assert all(m["moe/routing_replay_frac"] == 1.0 and m["rollout/logprob_mismatch_max"] <= 1e-5 for m in rows)


FAMILY = ["tiny_dapo", "tiny_gspo", "tiny_drgrpo", "tiny_cispo", "tiny_grpo_is", "tiny_rloo", "tiny_reinforce_pp",
          "tiny_ppo", "tiny_grpo_lora"]


def test_grpo_family_on_episodes(tmp_path):
    """Every GRPO-family recipe (and PPO's critic, and LoRA) runs a step on three-turn episodes (from a
    random start: the mechanics, not learning): the turns and observations are there and the
    log-prob mismatch bound holds over the generated tokens. GDPO needs named reward components,
    which this environment does not give (refused, tests/test_grpo_family.py)."""
    run_recipes([["--recipe", recipe, "train.max_steps=1", "train.eval_every=0", "logging.progress=false",
                  "logging.tensorboard=false", "checkpoint.save=false", "checkpoint.load=", "data.num_val=8",
                  "data.num_train=200", "algorithm.prompts_per_step=8", "rewards.fn=tests.test_episodes:Relay",
                  "rollout.max_turns=3", "rollout.max_new_tokens=4", f"logging.run_dir={tmp_path / recipe}",
                  *(["ppo.critic_warmup_steps=0"] if recipe == "tiny_ppo" else [])]  # the policy trains at once
                 for recipe in FAMILY])
    for recipe in FAMILY:
        step = [m for m in metrics(tmp_path / recipe) if "rollout/turns_mean" in m][-1]
        assert step["rollout/turns_mean"] > 1 and step["rollout/observation_tokens_mean"] > 0, recipe
        assert step["rollout/logprob_mismatch_max"] <= 1e-5 and "train/loss" in step, recipe
