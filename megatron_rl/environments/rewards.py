"""Rewards: one interface for reward functions and environments.

A reward function scores one sample: fn(prompt: str, completion: str, metadata: dict) -> float, or a
dict of named components (float each; their sum, or the configured weighting, is the reward).
Built in: 'exact_match' (the completion equals metadata['answer']) and 'math' (math-verify:
boxed or plain answers, LaTeX and numeric equivalence). Anything else is a dotted path
'package.module:function'. 'reward_model' scores with a trained reward model (environments/reward_model.py),
in the training processes rather than in workers.

A reward function is a single-turn environment (environments/__init__.py): each sample is scored in
a worker process with a time limit; a function that raises or hangs on one sample gives that sample
reward 0 and a counted warning; the run goes on.
"""

from megatron_rl.environments import EnvRunner, RewardEnvironment, Scores, load_environment


def build_scorer(cfg, spec: str, tokenizer):
    """What scores samples for reward spec `spec`: a RewardRunner over a reward function, or, for
    'reward_model', the frozen reward model of rewards.model (built collectively on every rank)."""
    if spec == "reward_model":
        from megatron_rl.environments.reward_model import RewardModel

        return RewardModel(cfg, cfg.rewards.model, tokenizer)
    r = cfg.rewards
    return RewardRunner(spec, r.timeout_s, r.workers, r.weights, cfg)


class RewardRunner:
    """Scores samples with the environment rewards.fn names (a reward function is a single-turn one),
    each sample in a worker process, limited to `timeout` seconds. score() takes one turn per sample;
    multi-turn episodes step self.runner (rollout/episodes.py)."""

    def __init__(self, spec: str, timeout: float = 10.0, workers: int = 1, weights: dict | None = None, cfg=None):
        self.spec, self.weights = spec, weights or {}
        self.env = load_environment(spec, cfg)
        self.runner = EnvRunner(self.env, timeout, workers)

    @property
    def multi_turn(self) -> bool:
        return not isinstance(self.env, RewardEnvironment)

    def score(self, prompts: list[str], completions: list[str], metadata: list[dict], ids=None) -> Scores:
        """ids: (prompt ids, completion ids) of the samples, which text-based functions do not need."""
        stepped = self.runner.step([[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                                    for p, c in zip(prompts, completions)], metadata)
        return combine([t.reward for t in stepped.turns], self.weights, stepped.failures, stepped.errors)

    def close(self):
        self.runner.close()


def combine(rewards: list, weights: dict, failures: int = 0, errors: list[str] | None = None) -> Scores:
    """Rewards (numbers, or dicts of named components) as Scores: components weighted and summed
    (unnamed weights 1)."""
    names = sorted({k for r in rewards if isinstance(r, dict) for k in r})
    components = {k: [r.get(k, 0.0) if isinstance(r, dict) else 0.0 for r in rewards] for k in names}
    total = [sum(weights.get(k, 1.0) * v for k, v in r.items()) if isinstance(r, dict) else float(r) for r in rewards]
    return Scores(total, components, failures, (errors or [])[:5])
