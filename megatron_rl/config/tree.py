"""The whole configuration tree: one section each, and what is checked across sections."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field

from .algorithm import AlgorithmConfig
from .base import ConfigError, positive
from .data import NEGATIVES, DataConfig
from .distill import DistillConfig
from .lora import LoRAConfig
from .model import ModelConfig
from .optimizer import OptimizerConfig, SchedulerConfig
from .parallel import ParallelConfig
from .ppo import PPOConfig
from .rollout import RewardsConfig, RolloutConfig
from .run import CheckpointConfig, LoggingConfig, ProfilingConfig
from .sandbox import SandboxConfig
from .train import FP8Config, TrainConfig


MLA_BLOCK_TOKENS = 64
MLA_BLOCKS = (f"megatron-core's latent KV cache, which multi-latent attention rolls out from, takes "
              f"{MLA_BLOCK_TOKENS}-token blocks")  # why a model with MLA needs them, said where taken and refused
UNEVEN_EXPERTS = ("the ranks of an expert-parallel group generate for different requests, so each engine step "
                  "feeds each its own number of tokens, which the allgather dispatcher cannot gather")
ON_POLICY = ("grpo", "distill", "ppo")  # loops that roll out algorithm.prompts_per_step x rollout.n samples per step


@dataclass(kw_only=True)
class Config:
    recipe: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def fit_to_model(self, chosen: set[str]) -> list[str]:
        """Settings the model needs, taken where the user did not choose them (`chosen`: the keys set on the
        command line) but the recipe did; one line for each. A choice the user made is checked by validate."""
        notes = []
        if (self.model.multi_latent_attention and self.rollout.block_size_tokens != MLA_BLOCK_TOKENS
                and "rollout.block_size_tokens" not in chosen):
            notes.append(f"rollout.block_size_tokens={MLA_BLOCK_TOKENS} (the recipe's {self.rollout.block_size_tokens}): "
                         f"{MLA_BLOCKS}")
            self.rollout.block_size_tokens = MLA_BLOCK_TOKENS
        if self._uneven_expert_rollouts() and "model.moe_dispatcher" not in chosen:
            notes.append(f"model.moe_dispatcher=alltoall (the recipe's allgather): {UNEVEN_EXPERTS}")
            self.model.moe_dispatcher = "alltoall"
        limit, d, r = self.model.max_position_embeddings, self.data, self.rollout
        if d.seq_length >= limit and not chosen & {"data.seq_length", "rollout.max_sequence_length"}:
            seq = (limit - 1) // 16 * 16
            notes.append(f"data.seq_length={seq} (the recipe's {d.seq_length}): the model takes at most {limit} "
                         f"positions; rollouts and packing shortened with it")
            d.seq_length, r.max_sequence_length = seq, min(r.max_sequence_length, seq + 1)
            r.max_new_tokens = min(r.max_new_tokens, seq // 2)
            self.rewards.overlong_buffer = min(self.rewards.overlong_buffer, r.max_new_tokens // 4)
            d.max_tokens_per_microbatch = min(d.max_tokens_per_microbatch, 8 * seq)
        return notes

    def _uneven_expert_rollouts(self) -> bool:
        """Rollouts at expert parallelism through the allgather dispatcher (UNEVEN_EXPERTS)."""
        p = self.parallel
        return (self.algorithm.name in ON_POLICY and self.model.num_experts > 0 and self.model.moe_dispatcher == "allgather"
                and (p.rollout_ep if p.rollout_ranks else p.ep) > 1)

    def validate(self, world_size: int = 1):
        """Check everything that can be checked before a model is built."""
        self.model.validate()
        self._validate_split(world_size)
        world_size = self.parallel.trainers(world_size)  # what follows is the training ranks'
        self.parallel.validate(world_size, self.model)
        self.optimizer.validate(self.train.precision)
        self.data.validate(self.parallel.data_parallel_size(world_size), uses_global_batch=self.algorithm.name not in ON_POLICY)
        self._validate_heads_and_rewards()
        self.fp8.validate()
        p = self.parallel
        split = p.sequence_divisor()
        if self.data.seq_length % split:
            raise ConfigError(
                f"data.seq_length={self.data.seq_length} must be divisible by {split}: 2 chunks per context-parallel "
                f"rank times tp with sequence parallelism; change data.seq_length or parallel.cp/tp.")
        self._validate_packing()
        self.lora.validate()
        self.sandbox.validate()
        if self.lora.rank % self.parallel.tp:
            raise ConfigError(f"lora.rank={self.lora.rank} must be divisible by parallel.tp={self.parallel.tp} (the "
                              f"adapters of column-parallel layers split their rank over tensor-parallel ranks).")
        if self.lora.rank and self.lora.dropout and self.algorithm.name in ON_POLICY:
            raise ConfigError(f"lora.dropout={self.lora.dropout} is refused for algorithm.name={self.algorithm.name}: a "
                              f"random forward breaks the agreement of rollout and training log-probs; set lora.dropout=0.")
        if self.algorithm.name == "distill":
            self.distill.validate()
        if self.algorithm.name == "ppo":
            self._validate_ppo()
        if self.algorithm.name in ON_POLICY:
            self._validate_grpo(self.parallel.data_parallel_size(world_size))
        if self.algorithm.name == "dpo":
            self._validate_dpo()
        positive(self.train, "max_steps", "max_skipped_steps")
        if self.train.threads < 0:
            raise ConfigError(f"train.threads={self.train.threads} must be >= 0 (0: torch's default).")
        if self.train.eval_every < 0 or self.checkpoint.save_every < 0:
            raise ConfigError("train.eval_every and checkpoint.save_every must be >= 0 (0 means at the end only).")
        self._validate_wandb()
        return self

    def _validate_split(self, world_size: int):
        """Generation ranks (parallel.rollout_ranks) and stale rollouts (algorithm.max_staleness)."""
        p, a = self.parallel, self.algorithm
        p.validate_split(world_size, self.model)
        if p.rollout_ranks and a.name not in ("grpo", "ppo"):
            raise ConfigError(f"parallel.rollout_ranks={p.rollout_ranks} gives generation ranks to a loop that rolls out; "
                              f"algorithm.name={a.name} does not (only grpo and ppo do): set parallel.rollout_ranks=0.")
        if p.rollout_ranks:
            copies, trainers_dp = p.rollout_ranks // p.rollout_tp, p.data_parallel_size(p.trainers(world_size))
            if trainers_dp % copies:
                raise ConfigError(f"the {copies} data-parallel copies of the generation ranks (parallel.rollout_ranks="
                                  f"{p.rollout_ranks} / rollout_tp={p.rollout_tp}) must divide the training ranks' "
                                  f"{trainers_dp} data-parallel ranks, each copy serving the same number of them; "
                                  f"change parallel.rollout_ranks or rollout_tp.")
        if a.max_staleness < 0:
            raise ConfigError(f"algorithm.max_staleness={a.max_staleness} must be >= 0 (0: rollouts of each step's own "
                              f"weights).")
        if a.stale() and not p.rollout_ranks:
            raise ConfigError(f"algorithm.max_staleness={a.max_staleness} needs generation ranks that roll out while the "
                              "others train: set parallel.rollout_ranks (e.g. 1), or max_staleness=0.")
        if a.stale() and a.off_policy == "none":
            raise ConfigError(f"algorithm.max_staleness={a.max_staleness} trains on rollouts of older weights, which "
                              "without a correction biases the gradient: set algorithm.off_policy=decoupled (or "
                              "rollout_ratio), or max_staleness=0.")

    def _validate_wandb(self):
        g, hints = self.logging, typing.get_type_hints(LoggingConfig)
        for name in ("wandb_mode", "wandb_resume"):
            choices = typing.get_args(hints[name])  # the field's Literal, "" (unset) first
            if getattr(g, name) not in choices:  # it came from W&B's environment variable
                raise ConfigError(f"logging.{name}={getattr(g, name)!r} is not one of {', '.join(choices[1:])}; fix "
                                  f"${name.upper()} or set logging.{name}.")
        if g.wandb_project:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("logging.wandb_project needs Weights & Biases: pip install wandb (or pip install -e "
                                  "'.[wandb]'), or leave logging.wandb_project (and $WANDB_PROJECT) empty.")

    def _validate_grpo(self, dp: int):
        a, r = self.algorithm, self.rollout
        r.validate()
        positive(a, "prompts_per_step", "minibatches", "epochs")
        samples = a.prompts_per_step * r.n
        if a.prompts_per_step % dp or samples % (a.minibatches * self.data.micro_batch_size * dp):
            raise ConfigError(
                f"algorithm.prompts_per_step x rollout.n = {samples} samples must split into algorithm.minibatches="
                f"{a.minibatches} minibatches of whole microbatches (data.micro_batch_size={self.data.micro_batch_size})"
                f" on each of {dp} data-parallel ranks, and prompts_per_step into the ranks; adjust them.")
        if r.max_turns > 1 and self.rewards.fn == "reward_model":
            raise ConfigError(f"rollout.max_turns={r.max_turns} needs an environment to answer the turns; a reward model "
                              "scores one completion: set rollout.max_turns=1.")
        if r.max_sequence_length < self.data.seq_length + 1:
            raise ConfigError(f"rollout.max_sequence_length={r.max_sequence_length} must exceed data.seq_length="
                              f"{self.data.seq_length} (the training length of prompt + completion).")
        if a.policy_loss == "cispo" and a.ratio_level == "sequence":
            raise ConfigError("algorithm.policy_loss=cispo weights each token's log-probability by its own ratio; it "
                              "has no sequence-level ratio: set algorithm.ratio_level=token (or policy_loss=ppo for GSPO).")
        if a.dual_clip and (a.policy_loss == "cispo" or a.dual_clip <= 1):
            raise ConfigError(f"algorithm.dual_clip={a.dual_clip} must be > 1 and needs algorithm.policy_loss=ppo; "
                              f"set it to 0 to turn it off.")
        if a.ratio_level == "sequence" and a.loss_aggregation != "sequence":
            raise ConfigError("algorithm.ratio_level=sequence (GSPO) gives one loss per sequence: set "
                              "algorithm.loss_aggregation=sequence.")
        if a.ratio_level == "sequence" and a.mismatch_correction.startswith("token"):
            raise ConfigError("a sequence-level ratio (GSPO) needs a sequence-level mismatch correction: use "
                              "algorithm.mismatch_correction=sequence_truncate or sequence_mask.")
        if self.model.hybrid_pattern and self.parallel.cp > 1:
            raise ConfigError("a hybrid model's rollouts need parallel.cp=1 (megatron-core's Mamba decode has no "
                              "context parallelism); train it at cp=1, or use context parallelism for SFT only.")
        if self.model.multi_latent_attention and r.block_size_tokens != MLA_BLOCK_TOKENS:
            raise ConfigError(f"rollout.block_size_tokens={r.block_size_tokens}: {MLA_BLOCKS}; set "
                              f"rollout.block_size_tokens={MLA_BLOCK_TOKENS}.")
        if self._uneven_expert_rollouts():
            raise ConfigError(f"model.moe_dispatcher=allgather cannot roll out at expert parallelism: {UNEVEN_EXPERTS}; "
                              "set model.moe_dispatcher=alltoall.")
        if a.router_replay and not self.model.num_experts:
            raise ConfigError("algorithm.router_replay=true needs an MoE model (model.num_experts > 0).")
        if self.parallel.cp > 1 and (a.ratio_level == "sequence" or a.mismatch_correction.startswith("sequence")):
            raise ConfigError("sequence-level ratios (algorithm.ratio_level=sequence, sequence mismatch corrections) "
                              "need each sequence whole on one rank; use parallel.cp=1 with them.")
        if a.advantage_estimator in ("rloo", "reinforce_pp") and r.n < 2:
            raise ConfigError(f"algorithm.advantage_estimator={a.advantage_estimator} compares each sample with the "
                              f"other samples of its prompt: set rollout.n >= 2.")
        if a.advantage_estimator == "rloo" and a.std_normalization == "batch":
            raise ConfigError("algorithm.advantage_estimator=rloo is the leave-one-out baseline without std scaling; "
                              "for batch scaling use advantage_estimator=grpo with baseline=loo.")
        if a.advantage_estimator == "reinforce_pp" and (a.baseline != "mean" or a.std_normalization == "batch"):
            raise ConfigError("algorithm.advantage_estimator=reinforce_pp subtracts the group mean and whitens over "
                              "the global batch itself: leave algorithm.baseline=mean and std_normalization unset.")
        if a.advantage_estimator == "reinforce_pp" and a.ratio_level == "sequence":
            raise ConfigError("algorithm.advantage_estimator=reinforce_pp gives each token its own advantage: set "
                              "algorithm.ratio_level=token.")
        if a.advantage_estimator == "gdpo" and a.baseline != "mean":
            raise ConfigError("algorithm.advantage_estimator=gdpo normalizes each component by its group mean and std; "
                              "set algorithm.baseline=mean.")
        if a.mismatch_threshold <= 1:
            raise ConfigError(f"algorithm.mismatch_threshold={a.mismatch_threshold} must be > 1.")
        if not 0 <= self.rewards.overlong_buffer < r.max_new_tokens:
            raise ConfigError(f"rewards.overlong_buffer={self.rewards.overlong_buffer} must be in [0, "
                              f"rollout.max_new_tokens={r.max_new_tokens}).")

    def _validate_ppo(self):
        self.ppo.validate()
        a = self.algorithm
        if a.advantage_estimator != "grpo" or a.ratio_level != "token":
            raise ConfigError("algorithm.name=ppo takes its per-token advantages from the critic (GAE): leave "
                              "algorithm.advantage_estimator and ratio_level unset.")

    def _validate_packing(self):
        budget, p = self.data.max_tokens_per_microbatch, self.parallel
        if not budget:
            return
        if self.algorithm.name == "rm":
            raise ConfigError("data.max_tokens_per_microbatch packs SFT, GRPO and DPO microbatches; reward models are "
                              "not packed yet: set it to 0 with algorithm.name=rm.")
        longest = -(-self.data.seq_length // 16) * 16 * (2 if self.algorithm.name == "dpo" else 1)
        if self.algorithm.name == "distill" and self.distill.cross_tokenizer:
            raise ConfigError("distill.cross_tokenizer=true builds its own batches of two tokenizations; set "
                              "data.max_tokens_per_microbatch=0 with it.")
        if budget < longest or budget % (p.tp if p.sp else 1):
            raise ConfigError(f"data.max_tokens_per_microbatch={budget} must hold the longest sample ({longest} tokens: "
                              f"data.seq_length rounded up to 16{', twice for a DPO pair' if self.algorithm.name == 'dpo' else ''})"
                              f"{f' and be a multiple of tp={p.tp} (sequence parallelism)' if p.sp else ''}; raise it.")

    def _validate_heads_and_rewards(self):
        a, m, r = self.algorithm, self.model, self.rewards
        if a.name == "rm" and m.head != "score":
            raise ConfigError("algorithm.name=rm trains a scalar score head: set model.head=score.")
        if a.name != "rm" and m.head != "lm":
            raise ConfigError(f"algorithm.name={a.name} trains a language model, but model.head={m.head!r}: set "
                              f"model.head=lm (a reward model is trained with algorithm.name=rm).")
        if (r.fn == "reward_model") != bool(r.model):
            raise ConfigError("rewards.fn=reward_model and rewards.model=PATH go together: set both (a reward-model "
                              "checkpoint or HF *ForSequenceClassification directory) or neither.")
        d = self.data
        if min(d.max_prompt_length, d.max_completion_length) < 0:
            raise ConfigError("data.max_prompt_length and data.max_completion_length must be >= 0 (0: no limit).")
        if a.name in ("dpo", "rm") and d.task == "arithmetic":
            unknown = sorted(set(d.negatives) - set(NEGATIVES))
            if unknown or not d.negatives or min(d.negatives.values()) < 0 or not sum(d.negatives.values()):
                raise ConfigError(f"data.negatives={d.negatives} must give non-negative weights (not all 0) to kinds "
                                  f"among {', '.join(NEGATIVES)}.")
            if "policy" in d.negatives and not (d.negatives_from or self.checkpoint.load or m.hf_path):
                raise ConfigError("data.negatives has 'policy', wrong answers sampled from a language model: set "
                                  "data.negatives_from (or checkpoint.load, or model.hf_path) to it.")

    def _validate_dpo(self):
        a = self.algorithm
        if not (self.checkpoint.load or self.model.hf_path):
            raise ConfigError("DPO starts from a policy, which is also its reference: set checkpoint.load or "
                              "model.hf_path.")
        if a.beta <= 0:
            raise ConfigError(f"algorithm.beta={a.beta} must be positive (DPO's KL strength; 0.1 is usual).")
        if a.preference_loss == "ipo" and a.average_logprobs is False:
            raise ConfigError("algorithm.preference_loss=ipo is defined on per-token mean log-ratios; unset "
                              "algorithm.average_logprobs (none) or set it to true.")
        if a.label_smoothing and a.preference_loss == "sigmoid":
            raise ConfigError(f"algorithm.label_smoothing={a.label_smoothing} does nothing to preference_loss=sigmoid "
                              f"(as in TRL): set algorithm.preference_loss=cdpo for conservative DPO (what label "
                              f"smoothing meant here before) or robust for TRL's robust DPO.")
        if not 0 <= a.label_smoothing < 0.5 or (a.label_smoothing and a.preference_loss not in ("cdpo", "robust")):
            raise ConfigError(f"algorithm.label_smoothing={a.label_smoothing} must be in [0, 0.5) and needs "
                              f"algorithm.preference_loss=cdpo or robust.")
        if a.sft_loss_weight < 0:
            raise ConfigError(f"algorithm.sft_loss_weight={a.sft_loss_weight} must be >= 0.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

