"""Environments: what answers a model's turn. One interface for reward functions (single-turn), tools
and games (multi-turn).

An environment's `step(conversations, metadata)` takes a batch of episodes so far (each a list of
{'role', 'content'} messages: 'user' for the prompt, 'assistant' for the model's turns, 'environment'
for what it answered before) with each episode's metadata (the data row's fields, then whatever the
environment returned last), and returns one `Turn` per episode: the observation to append, the reward
(a number, or named components), whether the episode is done, the answer it extracted (for maj@k),
the stop strings of the next turn, and the episode's metadata for its next step.

A reward function fn(prompt, completion, metadata) is the single-turn environment `RewardEnvironment`.
Environments are named as reward functions are (rewards.fn): a built-in name ('exact_match', 'math',
'code', 'sliding_puzzle') or 'package.module:name' naming a function or an Environment subclass (built
with the run's Config).

`EnvRunner` steps each episode in a worker process with its own time limit: an episode whose step
raises, hangs or returns something malformed ends with reward 0, counted, and the batch goes on.
`check_environment` runs an environment through the contract; the built-in ones are tested with it.
"""

import importlib
import inspect
import math
import multiprocessing as mp
from dataclasses import dataclass, field

from megatron_rl.config import ConfigError


@dataclass
class Turn:
    """One episode's result of a step."""

    reward: float | dict = 0.0
    done: bool = True
    observation: str = ""  # appended to the episode (out of the loss) when it goes on
    answer: str | None = None  # the answer the episode gave, for majority voting
    stop: list[str] | None = None  # the next turn's stop strings (None: the rollout's own)
    metadata: dict | None = None  # the episode's metadata from now on (None: unchanged)


@dataclass
class Scores:
    """A batch's rewards: the total per sample and, for named components, each component per sample."""

    rewards: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    failures: int = 0  # samples whose scoring raised or timed out (reward 0)
    errors: list[str] = field(default_factory=list)  # a few of their messages


class Environment:
    """Subclass it and implement step_one (one episode; EnvRunner gives each its own time limit and
    process), or step for the whole batch at once (then batched = True: called in the training
    process, responsible for its own time limits)."""

    batched = False
    stop: list[str] = []  # stop strings of the first turn (besides the rollout's and eos)
    role = "user"  # its observations' role in a chat template (rollout.observation_format=chat)

    def step(self, conversations: list[list[dict]], metadata: list[dict]) -> list[Turn]:
        return [self.step_one(c, m) for c, m in zip(conversations, metadata)]

    def step_one(self, conversation: list[dict], metadata: dict) -> Turn:
        raise NotImplementedError

    def close(self):
        pass


def last_of(conversation: list[dict], role: str) -> str:
    """The content of the last message of `role` ('' if none)."""
    return next((m["content"] for m in reversed(conversation) if m["role"] == role), "")


class RewardEnvironment(Environment):
    """A reward function as a single-turn environment: the reward of the completion, done; the answer is
    the completion's stripped text."""

    def __init__(self, fn):
        self.fn = fn

    def step_one(self, conversation, metadata):
        completion = last_of(conversation, "assistant")
        reward = self.fn(last_of(conversation, "user"), completion, metadata)
        return Turn(reward=reward, done=True, answer=completion.strip() or None)


def load_reward(spec: str):
    """The reward function named by a built-in name or 'package.module:function'."""
    from megatron_rl.environments.builtin import BUILTIN

    if spec in BUILTIN:
        return BUILTIN[spec]
    fn = _load_dotted(spec)
    if inspect.isclass(fn):
        raise ConfigError(f"rewards.fn={spec!r} is a class but not an Environment subclass (megatron_rl.environments); "
                          "name a reward function or an Environment.")
    if not callable(fn):
        raise ConfigError(f"rewards.fn={spec!r} is not callable; name a reward function or an Environment subclass.")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        raise ConfigError(f"rewards.fn={spec!r} takes {inspect.signature(fn)}, but a reward function is called as "
                          "fn(prompt, completion, metadata).") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    return fn


def _load_dotted(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise ConfigError(f"rewards.fn={spec!r} is neither a built-in ({', '.join(builtin_names())}, reward_model) "
                          f"nor 'module:function' (a reward function, or an Environment subclass).")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rewards.fn={spec!r} cannot be loaded ({e}); check the module path and name.") from None


def builtin_names() -> list[str]:
    from megatron_rl.environments.builtin import BUILTIN

    return [*BUILTIN, *ENVIRONMENTS]


ENVIRONMENTS = {"code": "megatron_rl.environments.code:CodeEnvironment",
                "code_off": "megatron_rl.environments.code:CodeOff",
                "sliding_puzzle": "megatron_rl.environments.puzzle:SlidingPuzzle"}


def load_environment(spec: str, cfg=None) -> Environment:
    """The environment rewards.fn names: a built-in environment or reward function, or a dotted path
    to an Environment subclass (built as cls(cfg)) or a reward function."""
    from megatron_rl.environments.builtin import BUILTIN

    if spec in BUILTIN:
        return RewardEnvironment(BUILTIN[spec])
    target = _load_dotted(ENVIRONMENTS.get(spec, spec))
    if inspect.isclass(target) and issubclass(target, Environment):
        return target(cfg)
    return RewardEnvironment(load_reward(spec))


def _finite(value, what: str) -> float:
    """A reward as a float; anything but a finite number (None, a string, NaN, inf) fails the episode."""
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"the {what} is {value!r}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"the {what} is {number}, not a finite number")
    return number


def checked(turn) -> Turn:
    """A Turn with a finite reward (or finite named components) and fields of the right types."""
    if not isinstance(turn, Turn):
        raise TypeError(f"a step returned {type(turn).__name__}, not a Turn")
    if isinstance(turn.reward, dict):
        turn.reward = {k: _finite(v, f"component {k!r}") for k, v in turn.reward.items()}
    else:
        turn.reward = _finite(turn.reward, "reward")
    if not isinstance(turn.observation, str) or not isinstance(turn.done, bool):
        raise TypeError(f"a step returned observation {type(turn.observation).__name__} and done "
                        f"{type(turn.done).__name__}, not str and bool")
    if turn.stop is not None and not (isinstance(turn.stop, list) and all(isinstance(s, str) for s in turn.stop)):
        raise TypeError(f"a step returned stop strings {turn.stop!r}, not a list of strings")
    if turn.metadata is not None and not isinstance(turn.metadata, dict):
        raise TypeError(f"a step returned metadata {type(turn.metadata).__name__}, not a dict")
    return turn


def _step_one(env, conversation, metadata):
    return checked(env.step_one(conversation, metadata))


def _quiet_on_sigterm():
    """Workers end by SIGTERM (Pool.terminate): megatron-core's inference coordinator registers a
    faulthandler stack dump for it at import, which would print every worker's stack at exit."""
    import faulthandler
    import signal

    faulthandler.unregister(signal.SIGTERM)


@dataclass
class Stepped:
    turns: list[Turn]
    failed: list[bool]  # per episode: its step raised, timed out or returned something malformed (reward 0, done)
    errors: list[str] = field(default_factory=list)  # a few of their messages

    @property
    def failures(self) -> int:
        return sum(self.failed)


class EnvRunner:
    """Steps episodes in worker processes, each episode's step limited to `timeout` seconds."""

    def __init__(self, env: Environment, timeout: float = 10.0, workers: int = 1):
        self.env, self.timeout, self.workers = env, timeout, workers
        self.pool = None

    def _pool(self):
        if self.pool is None:
            # fork: the workers inherit the environment (also one defined in a test or notebook)
            self.pool = mp.get_context("fork").Pool(self.workers, initializer=_quiet_on_sigterm)
        return self.pool

    def step(self, conversations: list[list[dict]], metadata: list[dict]) -> Stepped:
        if self.env.batched:
            return self._step_batched(conversations, metadata)
        from megatron_rl.platform import watchdog

        episodes = list(zip(conversations, metadata))
        turns, failed, errors = [], [], []
        while len(turns) < len(episodes):
            pending = [self._pool().apply_async(_step_one, (self.env, *e)) for e in episodes[len(turns):]]
            for job in pending:
                watchdog.beat("environment")  # slow environments are progress too
                i = len(turns)
                try:
                    turns.append(job.get(timeout=self.timeout))
                    failed.append(False)
                except mp.TimeoutError:
                    errors.append(f"sample {i}: no result within {self.timeout:g} s")
                    turns.append(Turn(reward=0.0, done=True))
                    failed.append(True)
                    self.pool.terminate()  # its worker is stuck: start over with the episodes left
                    self.pool = None
                    break
                except Exception as e:  # the step raised
                    errors.append(f"sample {i}: {type(e).__name__}: {e}")
                    turns.append(Turn(reward=0.0, done=True))
                    failed.append(True)
        return Stepped(turns, failed, errors[:5])

    def _step_batched(self, conversations, metadata) -> Stepped:
        turns = self.env.step(conversations, metadata)
        if not isinstance(turns, list) or len(turns) != len(conversations):
            got = len(turns) if isinstance(turns, list) else type(turns).__name__
            raise ValueError(f"environment {type(self.env).__name__} returned {got} turns for {len(conversations)} "
                             f"episodes; its step must return one Turn per episode.")
        out, failed, errors = [], [], []
        for i, turn in enumerate(turns):
            try:
                out.append(checked(turn))
                failed.append(False)
            except (TypeError, ValueError) as e:
                errors.append(f"sample {i}: {type(e).__name__}: {e}")
                out.append(Turn(reward=0.0, done=True))
                failed.append(True)
        return Stepped(out, failed, errors[:5])

    def close(self):
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None
        self.env.close()


def check_environment(env: Environment, conversations: list[list[dict]], metadata: list[dict]) -> list[Turn]:
    """Run an environment through the contract on sample episodes (in this process, so that errors
    show): one valid Turn per episode, a done episode's observation empty, stop strings and metadata of
    the right types, and the same turns again for the same input (steps are functions of the episode
    and its metadata). Raises AssertionError saying what broke it."""
    import copy

    first = env.step(copy.deepcopy(conversations), copy.deepcopy(metadata))
    assert isinstance(first, list) and len(first) == len(conversations), \
        f"{type(env).__name__}.step returned {len(first) if isinstance(first, list) else type(first).__name__} " \
        f"turns for {len(conversations)} episodes"
    for i, turn in enumerate(first):
        try:
            checked(turn)
        except (TypeError, ValueError) as e:
            raise AssertionError(f"{type(env).__name__}, episode {i}: {e}") from None
        assert not (turn.done and turn.observation), f"{type(env).__name__}, episode {i}: done, with an observation"
    again = [checked(t) for t in env.step(copy.deepcopy(conversations), copy.deepcopy(metadata))]
    assert again == first, f"{type(env).__name__}.step gave other turns for the same episodes"
    return first
