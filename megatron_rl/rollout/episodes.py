"""Multi-turn episodes: the model's turns and an environment's observations, one training sequence each.

Turn by turn, every episode still going is generated (its prompt and everything after it, as token
ids) with its own stop strings and token budget; the environment steps the batch; each episode's
observation is tokenized on its own and appended, marked out of the loss (mask 0): its text, or with
rollout.observation_format=chat, what the chat template puts between the model's turns (the model's
end-of-turn tokens, the observation as a message, the generation prompt). The model's tokens
are kept exactly as generated, stop strings included: nothing is decoded and tokenized again, which
could change ids and break the agreement of rollout and training log-probs.

An episode ends when the environment says done, when the model ends its turn with eos, after
rollout.max_turns turns, or when the next observation (plus one token to answer it) would not fit
the sequence budget (then it is truncated: flagged, scored with what it earned). The budget is the
smaller of rollout.max_sequence_length and what training takes (data.seq_length + 1 tokens).
Rewards add up over the turns; an episode whose step fails gets reward 0.

megatron-core 0.16.1's engine has no prefix cache: each turn prefills its episode again (on CPU,
at these lengths, a small cost).
"""

from dataclasses import dataclass

import torch

from megatron_rl.config import ConfigError
from megatron_rl.rollout.engine import Rollout, sampling_seed


@dataclass
class Episodes:
    rollout: Rollout  # completions: every token after the prompt; masks: 1 generated, 0 observed
    rewards: list  # per episode, the sum over its turns (a number, or named components)
    answers: list  # per episode, the last answer the environment extracted (None: none)
    failures: int
    errors: list[str]
    stats: dict  # rollout/turns_mean, ... (this rank's episodes)


# Rollout's per-token fields and an observation token's value in each (the last three: top-p / top-k only)
OBSERVED = {"masks": 0.0, "logprobs": 0.0, "thresholds": float("-inf"), "kept": 0, "full_logprobs": 0.0}


def budget_of(cfg) -> int:
    """The most tokens an episode may hold: what the engine and training both take."""
    return min(cfg.rollout.max_sequence_length, cfg.data.seq_length + 1)


def is_multi_turn(cfg, scorer) -> bool:
    """Whether rollouts are episodes: an environment other than a reward function, or more turns."""
    return getattr(scorer, "multi_turn", False) or cfg.rollout.max_turns > 1


def check_observation_format(cfg, tokenizer):
    """At start (GRPO, tools/eval.py): chat observations need the tokenizer's chat template."""
    if cfg.rollout.observation_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rollout.observation_format=chat needs a tokenizer with a chat template, and this one has "
                          "none; use rollout.observation_format=text or a chat model's tokenizer.")


def generate_scored(engine, scorer, tokenizer, prompts: list[list[int]], metadata: list[dict], n: int, seed: int,
                    cfg=None, budget: int = 0, greedy: bool = False, tape=None):
    """n samples of each prompt and their Scores: one completion each, scored by the reward function
    or model; or, with a multi-turn environment (cfg says so; without cfg, single-turn), episodes of at
    most `budget` tokens. Returns (rollout, scores, the environment's answers (None for single-turn
    samples), episode statistics ({} for them))."""
    from megatron_rl.environments.rewards import combine
    from megatron_rl.data.tokenizer import decode_texts

    if cfg is not None and is_multi_turn(cfg, scorer):
        episodes = run_episodes(engine, scorer.runner, tokenizer, prompts, metadata, n, seed, cfg.rollout.max_turns,
                                budget, greedy, tape)
        scores = combine(episodes.rewards, scorer.weights, episodes.failures, episodes.errors)
        return episodes.rollout, scores, episodes.answers, episodes.stats
    rollout = engine.generate(prompts, n=n, seed=seed, greedy=greedy, tape=tape)
    texts = decode_texts(tokenizer, prompts)
    each = range(len(rollout.completions))
    scores = scorer.score([texts[i // n] for i in each], decode_texts(tokenizer, rollout.completions),
                          [metadata[i // n] for i in each], ids=(rollout.prompts, rollout.completions))
    return rollout, scores, None, {}


def observation_ids(tokenizer, text: str, form: str = "text", role: str = "user") -> list[int]:
    """An observation's token ids, tokenized on their own: its text; or (form 'chat') what the chat
    template renders between the model's turn and its next one: the model's end-of-turn tokens, the
    observation as a `role` message, and the generation prompt."""
    if form == "chat":
        mark = "\x00turn\x00"  # the model's turn, whose end the template closes
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "."}, {"role": "assistant", "content": mark}, {"role": role, "content": text}],
            tokenize=False, add_generation_prompt=True)
        text = rendered[rendered.index(mark) + len(mark):]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _add(total, reward):
    """Rewards summed over turns: numbers, or named components (a missing one counts 0)."""
    if isinstance(reward, dict):
        base = total if isinstance(total, dict) else {}
        return {k: base.get(k, 0.0) + reward.get(k, 0.0) for k in {*base, *reward}}
    if isinstance(total, dict):  # a number after named components: an environment mixing the two; ignored
        return total
    return total + reward


def run_episodes(engine, runner, tokenizer, prompts: list[list[int]], metadata: list[dict], n: int, seed: int,
                 max_turns: int, budget: int, greedy: bool = False, tape=None) -> Episodes:
    """n episodes per prompt (token ids), episode i*n + j of prompt i. runner: the environment's
    EnvRunner; budget: the most tokens an episode (prompt included) may hold. tape: an MoE model's
    RoutingTape: each token's experts are those of the pass that fed it first (its turn's prefill
    or decode), which later turns' prefills route it to again; the rollout holds each episode's."""
    from megatron_rl.data.tokenizer import decode_texts

    env = runner.env
    count = len(prompts) * n
    prompt = [list(prompts[i // n]) for i in range(count)]
    ids = [[] for _ in range(count)]
    per_token = {f: [[] for _ in range(count)] for f in list(OBSERVED)[: 5 if engine.filters(greedy) else 2]}
    conversation = [[{"role": "user", "content": text}] for text in decode_texts(tokenizer, prompts) for _ in range(n)]
    meta = [dict(metadata[i // n]) for i in range(count)]
    stop = [list(engine.cfg.stop) + list(env.stop)] * count
    reward, answer, failed = [0.0] * count, [None] * count, [False] * count
    turns, ending, generated, observed = [0] * count, ["max_turns"] * count, [0] * count, [0] * count
    errors, routes = [], [None] * count
    active = [i for i in range(count) if budget - len(prompt[i]) > 0]
    for i in set(range(count)) - set(active):
        ending[i] = "truncated"
        if tape is not None:
            routes[i] = torch.full((0, len(tape.layers), tape.topk), -1, dtype=torch.long)
    for turn in range(max_turns):
        if not engine.anyone(bool(active)):  # an expert-parallel group generates together
            break
        room = [budget - len(prompt[i]) - len(ids[i]) for i in active]
        out = engine.generate([prompt[i] + ids[i] for i in active], n=1, seed=sampling_seed(seed, round=turn),
                              greedy=greedy, stops=[stop[i] for i in active],
                              max_new_tokens=[min(engine.cfg.max_new_tokens, r) for r in room], tape=tape,
                              routes=[routes[i] for i in active] if tape is not None and turn else None)
        if not active:  # this rank's episodes ended: its experts served the others' turn
            continue
        for k, i in enumerate(active):
            if tape is not None:
                routes[i] = out.routes[k]
            ids[i] += out.completions[k]
            for f, values in per_token.items():
                values[i] += [1.0] * len(out.completions[k]) if f == "masks" else getattr(out, f)[k]
            generated[i] += len(out.completions[k])
            turns[i] += 1
            conversation[i].append({"role": "assistant", "content": tokenizer.decode(out.completions[k],
                                                                                     skip_special_tokens=True)})
        stepped = runner.step([conversation[i] for i in active], [meta[i] for i in active])
        errors += stepped.errors
        still = []
        for k, i in enumerate(active):
            t = stepped.turns[k]
            reward[i] = _add(reward[i], t.reward)
            if stepped.failed[k]:
                failed[i], ending[i] = True, "failed"
                continue
            if t.answer is not None:
                answer[i] = t.answer
            if t.metadata is not None:
                meta[i] = t.metadata
            eos = bool(out.completions[k]) and out.completions[k][-1] == tokenizer.eos_token_id
            if t.done or eos:
                ending[i] = "done"
                continue
            if turns[i] == max_turns:
                continue
            obs = observation_ids(tokenizer, t.observation, engine.cfg.observation_format, getattr(env, "role", "user"))
            if len(prompt[i]) + len(ids[i]) + len(obs) + 1 > budget:
                ending[i] = "truncated"
                continue
            ids[i] += obs
            for f, values in per_token.items():
                values[i] += [OBSERVED[f]] * len(obs)
            observed[i] += len(obs)
            conversation[i].append({"role": "environment", "content": t.observation})
            if t.stop is not None:
                stop[i] = list(engine.cfg.stop) + t.stop
            still.append(i)
        active = still
    reward = [({k: 0.0 for k in r} if isinstance(r, dict) else 0.0) if f else r for r, f in zip(reward, failed)]
    rollout = Rollout(prompts=prompt, completions=ids, truncated=[e == "truncated" for e in ending],
                      routes=routes if tape is not None else [], **per_token)
    return Episodes(rollout, reward, answer, sum(failed), errors[:5], episode_stats(turns, ending, generated, observed))


def episode_stats(turns: list[int], ending: list[str], generated: list[int], observed: list[int]) -> dict:
    """This rank's means over its episodes: turns (and their maximum), how they ended, tokens generated and
    observed."""
    count = len(turns)
    return {"rollout/turns_mean": sum(turns) / count, "rollout/turns_max": float(max(turns)),
            **{f"rollout/{e}_frac": ending.count(e) / count for e in ("done", "truncated", "max_turns")},
            "rollout/generated_tokens_mean": sum(generated) / count,
            "rollout/observation_tokens_mean": sum(observed) / count}
