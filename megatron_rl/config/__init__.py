"""The configuration tree a recipe fills, and `section.field=value` overrides.

Every component owns one dataclass, one module per section; `Config` (tree.py) holds them all.
Validation raises `ConfigError` with one sentence saying what is wrong and how to fix it; it never
rewrites a value.
"""

from .algorithm import AlgorithmConfig
from .base import ConfigError, UserError
from .data import DataConfig
from .distill import DistillConfig
from .lora import LoRAConfig
from .model import ModelConfig
from .optimizer import OptimizerConfig, SchedulerConfig
from .overrides import MOVED, all_keys, apply_overrides, from_dict
from .parallel import ParallelConfig
from .ppo import PPOConfig
from .rollout import RewardsConfig, RolloutConfig
from .run import CheckpointConfig, LoggingConfig, ProfilingConfig
from .sandbox import SandboxConfig
from .train import FP8Config, TrainConfig
from .tree import Config

__all__ = ["AlgorithmConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistillConfig", "FP8Config", "LoggingConfig", "LoRAConfig",
           "MOVED", "ModelConfig", "OptimizerConfig", "ParallelConfig", "PPOConfig", "ProfilingConfig", "RewardsConfig",
           "RolloutConfig", "SandboxConfig", "SchedulerConfig", "TrainConfig", "UserError", "all_keys", "apply_overrides", "from_dict"]
