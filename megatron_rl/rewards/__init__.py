"""Rewards: one interface for reward functions and environments.

A reward function scores one sample: fn(prompt: str, completion: str, metadata: dict) -> float, or a
dict of named components (float each; their sum, or the configured weighting, is the reward).
Built in: 'exact_match' (the completion equals metadata['answer']) and 'math' (math-verify:
boxed or plain answers, LaTeX and numeric equivalence). Anything else is a dotted path
'package.module:function'. 'reward_model' scores with a trained reward model (reward_model.py),
in the training processes rather than in workers.

Each sample is scored in a worker process with a time limit: a function that raises or hangs on
one sample gives that sample reward 0 and a counted warning; the run goes on.
"""

import importlib
import inspect
import math
import multiprocessing as mp
from dataclasses import dataclass, field

from megatron_rl.config import ConfigError
from megatron_rl.platform import watchdog

from .builtin import exact_match, exact_match_parts, math_answer

BUILTIN = {"exact_match": exact_match, "exact_match_parts": exact_match_parts, "math": math_answer}


def build_scorer(cfg, spec: str, tokenizer):
    """What scores samples for reward spec `spec`: a RewardRunner over a reward function, or, for
    'reward_model', the frozen reward model of rewards.model (built collectively on every rank)."""
    if spec == "reward_model":
        from .reward_model import RewardModel

        return RewardModel(cfg, cfg.rewards.model, tokenizer)
    r = cfg.rewards
    return RewardRunner(spec, r.timeout_s, r.workers, r.weights)


def load_reward(spec: str):
    """The reward function named by a built-in name or 'package.module:function'."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module, _, name = spec.partition(":")
    if not name:
        raise ConfigError(f"rewards.fn={spec!r} is neither a built-in ({', '.join(BUILTIN)}, reward_model) nor "
                          f"'module:function'.")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rewards.fn={spec!r} cannot be loaded ({e}); check the module path and function name.") from None
    if not callable(fn):
        raise ConfigError(f"rewards.fn={spec!r} is not callable.")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        raise ConfigError(f"rewards.fn={spec!r} takes {inspect.signature(fn)}, but a reward function is called as "
                          "fn(prompt, completion, metadata).") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    return fn


@dataclass
class Scores:
    rewards: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    failures: int = 0  # samples whose scoring raised or timed out (reward 0)
    errors: list[str] = field(default_factory=list)  # a few of their messages


def _score_one(fn, prompt, completion, metadata):
    out = fn(prompt, completion, metadata)
    if isinstance(out, dict):
        return {k: _finite(v, f"component {k!r}") for k, v in out.items()}
    return _finite(out, "reward")


def _finite(value, what: str) -> float:
    """A reward as a float; anything but a finite number (None, a string, NaN, inf) fails the sample."""
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"the {what} is {value!r}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"the {what} is {number}, not a finite number")
    return number


def _quiet_on_sigterm():
    """Workers end by SIGTERM (Pool.terminate): megatron-core's inference coordinator registers a
    faulthandler stack dump for it at import, which would print every worker's stack at exit."""
    import faulthandler
    import signal

    faulthandler.unregister(signal.SIGTERM)


class RewardRunner:
    """Scores samples in worker processes, each call limited to `timeout` seconds."""

    def __init__(self, spec: str, timeout: float = 10.0, workers: int = 1, weights: dict | None = None):
        self.spec, self.fn = spec, load_reward(spec)
        self.timeout, self.workers = timeout, workers
        self.weights = weights or {}
        self.pool = None

    def _pool(self):
        if self.pool is None:
            # fork: the workers inherit the function (also one defined in a test or notebook)
            self.pool = mp.get_context("fork").Pool(self.workers, initializer=_quiet_on_sigterm)
        return self.pool

    def score(self, prompts: list[str], completions: list[str], metadata: list[dict], ids=None) -> Scores:
        """ids: (prompt ids, completion ids) of the samples, which text-based functions do not need."""
        samples = list(zip(prompts, completions, metadata))
        results, failures, errors = [], 0, []
        while len(results) < len(samples):
            pending = [self._pool().apply_async(_score_one, (self.fn, *s)) for s in samples[len(results):]]
            for job in pending:
                watchdog.beat("rewards")  # slow reward functions are progress too
                i = len(results)
                try:
                    results.append(job.get(timeout=self.timeout))
                except mp.TimeoutError:
                    failures += 1
                    errors.append(f"sample {i}: no result within {self.timeout:g} s")
                    results.append(None)
                    self.pool.terminate()  # its worker is stuck: start over with the samples left
                    self.pool = None
                    break
                except Exception as e:  # the function raised
                    failures += 1
                    errors.append(f"sample {i}: {type(e).__name__}: {e}")
                    results.append(None)
        return self._combine(results, failures, errors)

    def _combine(self, results, failures, errors) -> Scores:
        names = sorted({k for r in results if isinstance(r, dict) for k in r})
        components = {k: [r.get(k, 0.0) if isinstance(r, dict) else 0.0 for r in results] for k in names}
        rewards = []
        for r in results:
            if isinstance(r, dict):
                rewards.append(sum(self.weights.get(k, 1.0) * v for k, v in r.items()))
            else:
                rewards.append(0.0 if r is None else r)
        return Scores(rewards, components, failures, errors[:5])

    def close(self):
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None
