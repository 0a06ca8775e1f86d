"""One module per algorithm loop; each exposes run(cfg, run_dir) -> final metrics."""

import importlib

ALGORITHMS = {name: f"megatron_rl.algorithms.{name}" for name in ("sft", "grpo", "dpo", "rm", "distill", "ppo")}


def get_algorithm(name: str):
    from megatron_rl.config import ConfigError

    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm.name {name!r}; known: {', '.join(sorted(ALGORITHMS))}.")
    return importlib.import_module(ALGORITHMS[name])
