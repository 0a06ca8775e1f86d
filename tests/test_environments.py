"""Environments: the contract every environment is run through, per-episode isolation of failures,
the code tool in its sandbox, the sliding puzzle, and loading by name."""

import json
import random
import re
import time
from collections import deque

import pytest

from megatron_rl.config import Config, ConfigError
from megatron_rl.environments import (EnvRunner, Environment, RewardEnvironment, Turn, check_environment,
                                      load_environment)
from megatron_rl.data import puzzle
from megatron_rl.environments.sandbox import isolation


def episode(prompt, *turns):
    """A conversation: the prompt, then the model's turns and the environment's answers alternating."""
    roles = ["assistant", "environment"]
    return [{"role": "user", "content": prompt}] + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def test_a_reward_function_is_a_single_turn_environment():
    env = load_environment("exact_match")
    turns = check_environment(env, [episode("1+2=", " 3"), episode("1+2=", "4"), episode("1+2=", "")],
                              [{"answer": "3"}] * 3)
    assert [(t.reward, t.done, t.answer) for t in turns] == [(1.0, True, "3"), (0.0, True, "4"), (0.0, True, None)]
    assert isinstance(load_environment("tests.test_environments:_reward"), RewardEnvironment)


def _reward(prompt, completion, metadata):
    return 1.0


class Flaky(Environment):
    """Each episode's metadata says how its step misbehaves."""

    def __init__(self, cfg=None):
        pass

    def step_one(self, conversation, metadata):
        kind = metadata["kind"]
        if kind == "raise":
            raise RuntimeError("broken episode")
        if kind == "hang":
            time.sleep(60)
        if kind == "not a turn":
            return 1.0
        if kind == "nan":
            return Turn(reward=float("nan"))
        if kind == "bad stop":
            return Turn(done=False, observation="x", stop="</code>")
        return Turn(reward=1.0, done=kind == "done", observation="" if kind == "done" else "more")


class WrongCount(Environment):
    batched = True

    def __init__(self, cfg=None):
        pass

    def step(self, conversations, metadata):
        return [Turn()] * (len(conversations) + 1)


def test_a_step_that_raises_hangs_or_returns_garbage_ends_only_its_episode():
    env = load_environment("tests.test_environments:Flaky")
    runner = EnvRunner(env, timeout=1.0)
    kinds = ["done", "raise", "go on", "hang", "not a turn", "nan", "bad stop", "done"]
    start = time.monotonic()
    stepped = runner.step([episode("p", "c")] * len(kinds), [{"kind": k} for k in kinds])
    runner.close()
    assert time.monotonic() - start < 15
    assert [(t.reward, t.done) for t in stepped.turns] == [
        (1.0, True), (0.0, True), (1.0, False), (0.0, True), (0.0, True), (0.0, True), (0.0, True), (1.0, True)]
    assert stepped.turns[2].observation == "more" and stepped.failures == 5
    assert stepped.errors[:2] == ["sample 1: RuntimeError: broken episode", "sample 3: no result within 1 s"]
    with pytest.raises(ValueError, match="returned 3 turns for 2 episodes; its step must return one Turn per episode"):
        EnvRunner(WrongCount()).step([episode("p", "c")] * 2, [{}] * 2)
    with pytest.raises(AssertionError, match="returned 3 turns for 2 episodes"):
        check_environment(WrongCount(), [episode("p", "c")] * 2, [{}] * 2)


def test_unknown_environments_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="is neither a built-in .*code, code_off, sliding_puzzle.* nor 'module:function'"):
        load_environment("no_such_env")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        load_environment("tests.test_environments:Nothing")


@pytest.mark.skipif(isolation() != "root", reason="the code tool's sandbox needs root and bubblewrap here")
def test_code_tool_runs_programs_in_the_sandbox():
    cfg = Config()
    cfg.sandbox.timeout_s = 2
    env = load_environment("code", cfg)
    assert env.stop == ["</code>"]
    turns = check_environment(env, [
        episode("123*456=", "<code>print(123*456)</code>"),
        episode("123*456=", "<code>while True: pass</code>"),
        episode("123*456=", "<code>print(1)</code>", "<result>1</result>", "56088"),
        episode("123*456=", "56000"),
        episode("123*456=", "<code>print('x' * 1000)</code>"),
    ], [{"answer": "56088"}] * 5)
    assert (turns[0].observation, turns[0].done, turns[0].stop) == ("<result>56088</result>", False, ["</code>"])
    assert turns[1].observation.startswith("<result>error: the program did not finish within") and not turns[1].done
    assert (turns[2].reward, turns[2].done, turns[2].answer) == (1.0, True, "56088")
    assert (turns[3].reward, turns[3].done) == (0.0, True)
    assert len(turns[4].observation) == len("<result></result>") + env.max_result_chars


def shortest_solution(board: str) -> int:
    size = len(board.split(" "))
    seen, queue = {board}, deque([(board, 0)])
    while queue:
        b, d = queue.popleft()
        if b == puzzle.solved(size):
            return d
        for m in puzzle.MOVES:
            after = puzzle.move(b, m)
            if after is not None and after not in seen:
                seen.add(after)
                queue.append((after, d + 1))
    raise AssertionError(f"{board} cannot be solved")


def test_sliding_puzzle_boards_moves_and_rewards(tmp_path):
    assert puzzle.solved(2) == "12 30" and puzzle.solved(3) == "123 456 780"
    rng = random.Random(0)
    for size, depth in ((2, 3), (3, 4), (3, 12)):
        for _ in range(20):
            board = puzzle.scramble(size, depth, rng)
            assert 0 < shortest_solution(board) <= depth  # solvable, never already solved

    env = load_environment("sliding_puzzle")
    board = "12 03"  # one move from solved: the empty cell moves right
    turns = check_environment(env, [episode(board, "<action>right</action>"),
                                    episode("", "<action>up</action>"),
                                    episode("", "<action>left</action>"),
                                    episode("", "I would move it right")], [{"board": board}] * 4)
    assert (turns[0].reward, turns[0].done, turns[0].metadata["board"]) == (1.0, True, "12 30")
    assert (turns[1].reward, turns[1].done, turns[1].observation) == (0.0, False, "02 13")
    assert turns[1].metadata == {"board": "02 13"} and turns[1].stop == ["</action>"]
    assert turns[2].observation == "12 03 invalid: the empty cell cannot move left from here"
    assert turns[3].observation.endswith("invalid: write one move as <action>up</action> (or down, left, right)")
    assert not turns[2].done and not turns[3].done and turns[3].metadata is None

    for i in range(20):  # solutions as demonstration turns (shortest, or with detours), replayed through the environment
        board = puzzle.scramble(3, 8, rng)
        demo = puzzle.demonstration(board, rng, detour=0.5 * (i % 2))
        assert len(demo) == 2 * shortest_solution(board) - 1 if i % 2 == 0 else len(demo) >= 2 * shortest_solution(board) - 1
        meta, conversation = {"board": board}, episode(board)
        for k in range(0, len(demo), 2):
            conversation.append(demo[k])
            turn = env.step_one(conversation, meta)
            meta = turn.metadata
            if k + 1 < len(demo):
                assert (turn.observation, turn.done) == (demo[k + 1]["content"], False)
                conversation.append(demo[k + 1])
        assert (turn.reward, turn.done) == (1.0, True)
    _, val = puzzle.write_splits(tmp_path, 20, 5, 3, 6, seed=0, detour=0.3)  # data.task=sliding_puzzle
    for row in map(json.loads, val.read_text().splitlines()):
        assert row["prompt"] == row["board"] and row["turns"] == puzzle.demonstration(row["board"])


def test_tool_demonstrations_train_the_model_turns_only(tmp_path):
    """The code-tool task's episodes: each turn tokenized on its own (as rollouts append them), the tool's
    result out of the loss; on large problems the demonstrator often skips the tool and estimates."""
    from megatron_rl.data import arithmetic
    from megatron_rl.data.rows import read_rows
    from megatron_rl.data.sft import encode
    from megatron_rl.data.tokenizer import build_char_tokenizer

    train, val = arithmetic.write_splits(tmp_path, 400, 20, 3, seed=0, noise=0.8, ops="*", tool="code")
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    skipped = [r for r in rows if len(r["turns"]) == 1]
    large = [r for r in rows if int(r["prompt"].split("*")[0]) >= arithmetic.SKIPS_FROM]
    assert all(r in large for r in skipped) and 0.7 < len(skipped) / len(large) < 0.9
    for r in rows:
        a, b = map(int, r["prompt"][:-1].split("*"))
        assert 100 <= a < 1000 and 100 <= b < 1000 and r["answer"] == str(a * b)
        contents = [t["content"] for t in r["turns"]]
        assert contents == ([str(round(a * b, -2))] if r in skipped else
                            [f"<code>print({a}*{b})</code>", f"<result>{a * b}</result>", str(a * b)])
    assert all(len(json.loads(x)["turns"]) == 3 for x in val.read_text().splitlines())
    tok = build_char_tokenizer(arithmetic.alphabet("*", "code"), tmp_path / "tok")
    assert tok.convert_ids_to_tokens(list(range(3, 15))) == list("0123456789+=")  # append-only
    r = next(r for r in rows if r not in skipped)
    assert tok.pad_token_id not in tok("".join(t["content"] for t in r["turns"]))["input_ids"]  # no unknown characters
    batch = encode(read_rows(train).keep([rows.index(r)]), tok, 80)
    ids = batch["labels"][0][batch["loss_mask"][0] > 0].tolist()
    trained = tok(r["turns"][0]["content"])["input_ids"] + tok(r["turns"][2]["content"])["input_ids"] + [tok.eos_token_id]
    assert ids == trained  # the tool's result is not trained on


@pytest.mark.skipif(isolation() != "root", reason="the code tool's sandbox needs root and bubblewrap here")
def test_grpo_with_the_code_tool(tmp_path):
    """A short tiny_tool_sft, then a GRPO step whose episodes call the sandboxed tool: the tool's results
    join the episodes out of the loss, the log-prob bound holds over the model's tokens."""
    from tests.helpers import metrics, run_train

    quick = ["logging.progress=false", "logging.tensorboard=false", "train.eval_every=0", "data.num_val=16"]
    sft = tmp_path / "sft"
    run_train(["--recipe", "tiny_tool_sft", *quick, "train.max_steps=300", "data.num_train=4000",
               f"logging.run_dir={sft}"])
    run = tmp_path / "grpo"
    run_train(["--recipe", "tiny_tool_grpo", *quick, "train.max_steps=1", "algorithm.prompts_per_step=8", "rollout.n=4",
               "data.micro_batch_size=32", "checkpoint.save=false", f"checkpoint.load={sft}", f"logging.run_dir={run}"])
    step = metrics(run)[-1]
    assert step["rollout/turns_mean"] > 1.2 and step["rollout/observation_tokens_mean"] > 5  # the tool was called
    assert step["rollout/reward_failure_frac"] == 0 and step["rollout/logprob_mismatch_max"] <= 1e-5
    assert "val/accuracy" in step


@pytest.mark.parametrize("recipe, overrides, message", [
    ("tiny_grpo_rm", ["rollout.max_turns=2"], "rollout.max_turns=2 needs an environment to answer the turns"),
    ("tiny_grpo", ["rollout.max_turns=0"], "rollout.max_turns=0 must be positive"),
    ("tiny_grpo", ["rollout.observation_format=xml"], "rollout.observation_format='xml' must be 'text' or 'chat'"),
    ("tiny_sft", ["data.tool=calculator"], "data.tool='calculator': the built-in tool is 'code'"),
    ("tiny_sft", ["data.ops=/"], "data.ops='/' must be '+', '-', '+-' or '*'"),
])
def test_multi_turn_settings_refused_in_one_sentence(recipe, overrides, message):
    from megatron_rl.config import apply_overrides
    from recipes import get_recipe

    with pytest.raises(ConfigError, match=re.escape(message)):
        apply_overrides(get_recipe(recipe), overrides).validate(world_size=1)
