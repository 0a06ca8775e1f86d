"""The rollout and rewards sections: generation and how samples are scored."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import ConfigError, positive


@dataclass(kw_only=True)
class RolloutConfig:
    """Generation with megatron-core's dynamic inference engine on the training model."""

    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (greedy evaluation ignores it)."""
    top_p: float = 0.0
    """Nucleus sampling; 0 turns it off. Cannot be combined with top_k. Training replays each token's kept
    set: its logprobs and loss are over the tokens the sampler kept, renormalized (docs/algorithms/grpo.md)."""
    top_k: int = 0
    """Sample among the k most likely tokens (and any tied with the k-th); 0 turns it off. Replayed in
    training as top_p is."""
    max_new_tokens: int = 16
    """The most tokens a sample (an episode's turn) generates."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (comma-separated on the command line); eos always stops."""
    max_turns: int = 1
    """Turns of the model per episode with a multi-turn environment (rewards.fn=code, sliding_puzzle...):
    the environment's observation follows each turn, out of the loss, and the episode is one training
    sequence of at most data.seq_length + 1 tokens."""
    observation_format: str = "text"
    """How an environment's observation joins an episode: 'text', its text tokenized on its own; 'chat',
    as a message (role: the environment's `role`, e.g. 'tool' or 'user') rendered by the tokenizer's
    chat template, with the end-of-turn tokens that close the model's turn and the generation prompt
    that opens its next one (prompts are then rendered with the same template)."""
    seed: int = 0
    """Sampling seed: step s on data-parallel rank r samples with seed + 7919 s + r, plus 104729 per
    dynamic-sampling round and per episode turn (rollout/engine.py sampling_seed), so a run is reproducible
    at any layout with the same data-parallel size."""
    max_sequence_length: int = 256
    """Longest prompt + completion the engine's KV cache takes."""
    max_requests: int = 512
    """Requests decoded together (continuous batching); more wait for a free slot."""
    max_tokens: int = 8192
    """Tokens per engine step (prefill chunks included)."""
    kv_cache_gb: float = 0.25
    """Memory of the inference engine's paged KV cache (megatron's buffer_size_gb)."""
    block_size_tokens: int = 32
    """KV cache block size (paged attention)."""
    cuda_graphs: bool = True
    """On CUDA, decode steps replay CUDA graphs (megatron-core's local graphs, one per batch size it
    captures at start; prefill steps and training run eagerly): the host launches a step in one call
    rather than kernel by kernel. Ignored on the CPU."""
    num_cuda_graphs: int = 16
    """Decode batch sizes with a CUDA graph (rollout.cuda_graphs): a step runs the smallest one that
    holds its requests."""
    batch_invariant: bool = False
    """Rollouts and training on megatron-core's batch-invariant kernels (Thinking Machines': matmul,
    log_softmax and mean whose every row is computed the same way whatever the batch), so that bf16
    rollout logprobs come closer to the training forward's. CUDA with Triton only; slower."""

    def validate(self):
        positive(self, "n", "max_new_tokens", "max_requests", "max_tokens", "block_size_tokens", "max_turns",
                 "num_cuda_graphs")
        if self.observation_format not in ("text", "chat"):
            raise ConfigError(f"rollout.observation_format={self.observation_format!r} must be 'text' or 'chat'.")
        if self.top_k and self.top_p:
            raise ConfigError("rollout.top_k and rollout.top_p cannot both be set; pick one (0 turns one off).")
        if self.top_k < 0:
            raise ConfigError(f"rollout.top_k={self.top_k} must be >= 0 (0 turns it off).")
        if not 0.0 <= self.top_p <= 1.0 or self.temperature <= 0:
            raise ConfigError("rollout.top_p must be in [0, 1] and rollout.temperature positive.")


@dataclass(kw_only=True)
class RewardsConfig:
    fn: str = "exact_match"
    """'exact_match', 'math' (math-verify) or 'package.module:function' (see megatron_rl/environments/rewards.py)."""
    timeout_s: float = 10.0
    """A sample whose scoring takes longer gets reward 0 (counted in rollout/reward_failures)."""
    workers: int = 1
    """Worker processes that score samples."""
    weights: dict[str, float] = field(default_factory=dict)
    """Weights of named reward components (name:weight,... on the command line); unnamed ones weigh 1."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: completions longer than rollout.max_new_tokens minus this many
    tokens lose up to overlong_penalty, linearly; 0 turns it off."""
    overlong_penalty: float = 1.0
    """DAPO: the most a completion at the length limit loses (see overlong_buffer)."""
    model: str = ""
    """rewards.fn=reward_model: a reward model, our checkpoint (algorithm.name=rm) or a Hugging
    Face *ForSequenceClassification directory; it runs in the policy's parallel layout."""
    val_fn: str = ""
    """The reward of validation (val/accuracy, val/reward_mean); empty means rewards.fn."""
