"""The configuration tree a recipe fills, and `section.field=value` overrides.

Every component owns one dataclass; `Config` holds them all. Validation raises `ConfigError`
with one sentence saying what is wrong and how to fix it; it never rewrites a value.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional


class ConfigError(ValueError):
    """A user mistake in a recipe or an override; the message says how to fix it."""


@dataclass(kw_only=True)
class ModelConfig:
    """The architecture. A Hugging Face checkpoint fills it through its family's provider
    (model.hf_path); recipes that train from scratch set it directly."""

    family: str = "llama"
    """Model family in model_providers/: llama, qwen, mixtral, deepseek, nemotron."""
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    """Hidden size of dense MLPs."""
    num_attention_heads: int = 4
    num_query_groups: int = 0
    """Key/value heads for GQA; 0 means as many as attention heads (plain multi-head attention)."""
    head_dim: int = 0
    """Channels per head; 0 means hidden_size // num_attention_heads."""
    vocab_size: int = 0
    """0 means take it from the tokenizer. Padded internally to a multiple of 128."""
    max_position_embeddings: int = 4096
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    zero_centered_gamma: bool = False
    """Norm weights stored as gamma - 1 (Nemotron's LayerNorm1P)."""
    norm_epsilon: float = 1e-6
    activation: Literal["swiglu", "squared_relu", "gelu", "silu"] = "swiglu"
    """MLP activation; swiglu is the gated SiLU (gate and up projections)."""
    tie_embeddings: bool = False
    qk_layernorm: bool = False
    """RMSNorm on queries and keys per head (Qwen3); with MLA, the norms of the compressed q and kv."""
    qkv_bias: bool = False
    """Bias on the query/key/value projection (Qwen2)."""
    sliding_window: int = 0
    """Attend to at most this many most recent tokens (Mistral); 0 means full causal attention."""
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    """Share of each head's channels that get rotary embeddings (Nemotron: 0.5)."""
    rope_scaling: Literal["none", "llama3", "yarn"] = "none"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    """llama3 rope scaling."""
    rope_high_freq_factor: float = 4.0
    """llama3 rope scaling."""
    rope_original_max_position: int = 8192
    """llama3 and yarn rope scaling: the context length the model was pretrained at."""
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (MLA); the q/kv sizes below apply."""
    q_lora_rank: int = 0
    """MLA: rank of the compressed query; 0 means queries are not compressed."""
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    """MLA: query/key channels per head without rotary embedding."""
    qk_pos_head_dim: int = 0
    """MLA: query/key channels per head with rotary embedding."""
    v_head_dim: int = 0
    num_experts: int = 0
    """Routed experts per MoE layer; 0 means a dense model."""
    moe_ffn_hidden_size: int = 0
    moe_shared_ffn_hidden_size: int = 0
    """Hidden size of the shared experts (all of them together); 0 means none."""
    moe_first_dense_layers: int = 0
    """The first N layers are dense (DeepSeek's first_k_dense_replace)."""
    moe_topk: int = 2
    moe_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_pre_softmax: bool = False
    """Softmax over all experts, then top-k, without renormalizing; false: softmax over the top-k."""
    moe_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only (DeepSeek-V3)."""
    moe_expert_bias_update_rate: float = 0.0
    """How fast training moves that bias toward balanced load; 0 keeps it fixed (the RL default)."""
    moe_num_groups: int = 0
    """Group-limited routing: experts in this many groups, tokens routed within moe_group_topk of them."""
    moe_group_topk: int = 0
    moe_topk_scaling_factor: float = 1.0
    """Routing weights are multiplied by this (DeepSeek-V3: 2.5)."""
    moe_aux_loss_type: Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"] = "none"
    moe_aux_loss_coeff: float = 0.0
    moe_router_dtype: Literal["fp32", "fp64", "model"] = "fp32"
    """Precision of the router's logits and probabilities; 'model' uses the model's dtype."""
    moe_capacity_factor: float = 0.0
    """Tokens per expert are capped at this factor times the even share; 0 means no dropping."""
    moe_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    init_method_std: float = 0.02
    hf_path: str = ""
    """A Hugging Face checkpoint directory: its config.json sets this section and its weights
    are loaded at the start (see tools/convert_checkpoint.py)."""
    head: Literal["lm", "score"] = "lm"
    """What sits on the last layer: the vocabulary output layer ('lm'), or one scalar per token
    ('score': a reward model, algorithm.name=rm; embeddings are then untied). A score model
    started from a language model drops its output layer and gets a fresh head."""

    def validate(self):
        _positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={groups}; pick a number of key/value heads that divides it.")
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
                f"{self.num_attention_heads}; set model.head_dim explicitly or change the sizes.")
        if self.num_experts:
            _positive(self, "moe_ffn_hidden_size", "moe_topk")
            if self.moe_topk > self.num_experts:
                raise ConfigError(f"model.moe_topk={self.moe_topk} exceeds model.num_experts={self.num_experts}.")
            if self.moe_num_groups and self.num_experts % self.moe_num_groups:
                raise ConfigError(f"model.num_experts={self.num_experts} is not divisible by "
                                  f"model.moe_num_groups={self.moe_num_groups}.")
        if self.multi_latent_attention:
            _positive(self, "kv_lora_rank", "qk_head_dim", "qk_pos_head_dim", "v_head_dim")

    TRAINING_CHOICES: ClassVar[tuple[str, ...]] = (
        "hf_path", "head", "init_method_std", "moe_aux_loss_type", "moe_aux_loss_coeff", "moe_expert_bias_update_rate",
        "moe_router_dtype", "moe_capacity_factor", "moe_dispatcher")
    """Fields that are choices of a training run rather than of the architecture: a checkpoint or HF
    model does not fix them."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether (0-based) layer `layer` has routed experts."""
        return bool(self.num_experts) and layer >= self.moe_first_dense_layers


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    vpp: int = 1
    """Model chunks per pipeline stage (virtual pipeline / interleaved 1F1B); 1 means off."""
    cp: int = 1
    """Context parallel size."""
    ep: int = 1
    """Expert parallel size (MoE): experts are split over this many ranks of tp x cp x dp."""
    etp: int = 0
    """Tensor parallel size inside each expert; 0 means the same as tp."""
    sp: bool = False
    """Sequence parallel (needs tp > 1)."""
    dp: int = 0
    """Data parallel size; 0 means whatever the world size leaves after tp x pp x cp."""
    first_stage_layers: int = 0
    """Uneven pipeline: layers of the first stage (0: an even split); the middle stages share the rest."""
    last_stage_layers: int = 0
    """Uneven pipeline: layers of the last stage (0: an even split)."""

    def validate(self, world_size: int, model: ModelConfig | None = None):
        _positive(self, "tp", "pp", "vpp", "cp", "ep")
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp x pp x cp = {self.tp} x {self.pp} x "
                f"{self.cp} = {model_parallel}; launch a multiple of {model_parallel} processes "
                f"(torchrun --nproc_per_node N) or change parallel.tp/pp/cp.")
        dp = world_size // model_parallel
        if self.dp and self.dp != dp:
            raise ConfigError(
                f"parallel.dp={self.dp} but world size {world_size} / (tp x pp x cp = {model_parallel}) "
                f"= {dp}; launch {self.dp * model_parallel} processes or set parallel.dp={dp} (or 0).")
        if self.sp and self.tp == 1:
            raise ConfigError("parallel.sp=true needs parallel.tp > 1; set parallel.sp=false or raise tp.")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1 (it splits each pipeline stage).")
        expert_tp = self.etp or self.tp
        if (self.tp * self.cp * dp) % (self.ep * expert_tp):
            raise ConfigError(
                f"parallel.ep x expert tensor parallel = {self.ep} x {expert_tp} must divide tp x cp x dp = "
                f"{self.tp * self.cp * dp}; lower parallel.ep/etp or launch more processes.")
        if model is None:
            return
        if model.num_experts and self.tp > 1 and not self.sp:
            raise ConfigError("an MoE model with parallel.tp > 1 needs parallel.sp=true (megatron-core requires "
                              "sequence parallelism with experts and tensor parallelism).")
        if self.ep > 1 and (not model.num_experts or model.num_experts % self.ep):
            raise ConfigError(
                f"parallel.ep={self.ep} needs model.num_experts ({model.num_experts}) to be a multiple of it.")
        groups = model.num_query_groups or model.num_attention_heads
        for what, n in (("num_attention_heads", model.num_attention_heads),
                        ("num_query_groups", groups), ("ffn_hidden_size", model.ffn_hidden_size)):
            if n % self.tp:
                raise ConfigError(
                    f"model.{what}={n} is not divisible by parallel.tp={self.tp}; choose a tp that divides it.")
        if self.first_stage_layers or self.last_stage_layers:
            middle = self.pp - bool(self.first_stage_layers) - bool(self.last_stage_layers)
            rest = model.num_layers - self.first_stage_layers - self.last_stage_layers
            if self.vpp > 1 or middle < 0 or rest < 0 or (rest % middle if middle else rest):
                raise ConfigError(
                    f"parallel.first_stage_layers={self.first_stage_layers} and last_stage_layers="
                    f"{self.last_stage_layers} must leave the other {model.num_layers} - those layers evenly to the "
                    f"{middle} middle stages of parallel.pp={self.pp} (and parallel.vpp=1).")
        elif model.num_layers % (self.pp * self.vpp):
            raise ConfigError(
                f"model.num_layers={model.num_layers} is not divisible by parallel.pp x parallel.vpp = "
                f"{self.pp} x {self.vpp}; choose a layout whose stages get whole layers.")

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    distributed: bool = False
    """Megatron's distributed optimizer: shard optimizer state over data-parallel ranks."""

    def validate(self):
        _positive(self, "lr")
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr} exceeds optimizer.lr={self.lr}; lower min_lr.")


@dataclass(kw_only=True)
class SchedulerConfig:
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: int = 0
    """Steps from the start to the end of decay; 0 means train.max_steps."""


@dataclass(kw_only=True)
class DataConfig:
    task: str = "arithmetic"
    """A built-in synthetic task ('arithmetic'), or '' to read train_path/val_path."""
    train_path: str = ""
    """JSONL with {"prompt", "response"} or {"messages": [...]} rows."""
    val_path: str = ""
    tokenizer: str = ""
    """A Hugging Face tokenizer directory; empty means model.hf_path's, else the task's own (built locally)."""
    pad_token: str = ""
    """The tokenizer's pad token: empty keeps its own (eos when it has none), 'eos' pads with eos,
    anything else names a token. A reward model reads its score at the last token that is not the
    pad token, so with 'eos' at the last response token (as transformers does for such models)."""
    seq_length: int = 32
    """Tokens per sample after padding; longer samples are refused with their row number."""
    micro_batch_size: int = 16
    max_tokens_per_microbatch: int = 0
    """Sequence packing (SFT, GRPO, DPO): each microbatch holds as many samples as fit this many
    tokens, each padded only to a multiple of 16 (not to seq_length), in one row where no sample sees
    another; 0 means micro_batch_size samples of seq_length tokens each."""
    global_batch_size: int = 64
    """Samples per optimizer step over all data-parallel ranks."""
    num_train: int = 20000
    """Samples to generate for a synthetic task's training split."""
    num_val: int = 256
    digits: int = 3
    """Arithmetic task: maximum digits per operand."""
    noise: float = 0.0
    """Arithmetic task: share of training responses that are off by one (imperfect demonstrations);
    the 'answer' field, which rewards check, and the validation split stay exact."""
    seed: int = 0
    """Seed for generating and shuffling data."""
    negatives: dict[str, float] = field(default_factory=lambda: {"plus1": 1.0})
    """Arithmetic task, DPO and reward models: the mix of rejected answers, kind:weight with kinds
    plus1, minus1, plus10, minus10, random, and policy (wrong answers sampled from the starting
    checkpoint, checkpoint.load)."""
    negatives_from: str = ""
    """The language model whose wrong samples are the 'policy' negatives: a checkpoint (or run
    directory) or a Hugging Face directory; empty means checkpoint.load or model.hf_path."""
    max_prompt_length: int = 0
    """DPO and reward models: a longer prompt is cut to this many tokens (as truncation_mode
    says); 0 means no limit of its own."""
    max_completion_length: int = 0
    """DPO and reward models: a longer response keeps its first this many tokens (its eos
    included); 0 means no limit of its own."""
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    """DPO and reward models, for a pair still longer than data.seq_length allows: keep_end drops
    tokens from the start of the (shared) prompt, keep_start from the end of the responses.
    Truncated pairs are counted in the log (data/truncated_pairs)."""

    def validate(self, dp: int = 1, uses_global_batch: bool = True):
        """uses_global_batch: SFT's batches; GRPO's come from algorithm.prompts_per_step x rollout.n."""
        _positive(self, "seq_length", "micro_batch_size", "global_batch_size")
        if uses_global_batch and self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(
                f"data.global_batch_size={self.global_batch_size} is not divisible by data.micro_batch_size"
                f" x data-parallel size = {self.micro_batch_size} x {dp}; make it a multiple of "
                f"{self.micro_batch_size * dp}.")
        if not self.task and not self.train_path:
            raise ConfigError("set data.task to a built-in task or data.train_path to a JSONL file.")


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = "sft"
    """Which loop in megatron_rl/algorithms/ runs: sft, grpo, dpo or rm (reward model)."""
    early_stop_patience: int = 0
    """SFT: stop after this many evaluations without a better val/loss; 0 means never stop early."""
    prompts_per_step: int = 32
    """GRPO: prompts per step over all data-parallel ranks; each gets rollout.n samples."""
    minibatches: int = 1
    """GRPO: optimizer steps per rollout batch per epoch (the batch is split into this many)."""
    router_replay: bool = False
    """GRPO with MoE: the experts each token was routed to in the rollout are used in the old-policy,
    reference and training forwards and the backward (R3); off: their mismatch is measured."""
    epochs: int = 1
    """GRPO: passes over each rollout batch; the rollout-time policy stays the old policy."""
    clip_low: float = 0.2
    """GRPO: the ratio is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = 0.2
    kl_coef: float = 0.0
    """GRPO: weight of the KL penalty to the reference (the initial policy); 0 turns it and the
    reference model off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    baseline: Literal["mean", "loo"] = "mean"
    """GRPO advantage baseline: the group mean, or leave-one-out (the mean of the other samples)."""
    std_normalization: Literal["group", "batch", "none"] = "group"
    """GRPO: divide advantages by the group's reward std, the whole batch's, or not at all."""
    advantage_estimator: Literal["grpo", "gdpo"] = "grpo"
    """gdpo: each named reward component normalized within its group, weighted (rewards.weights),
    summed, then normalized over the batch (needs a reward function returning components)."""
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    """ppo: the clipped surrogate. cispo: the clipped importance weight as a stop-gradient
    coefficient on the log-probability (MiniMax-M1), so clipped tokens still learn."""
    ratio_level: Literal["token", "sequence"] = "token"
    """sequence: one importance ratio per sequence, the geometric mean of its token ratios (GSPO);
    clip_low/clip_high then clip that ratio (GSPO uses about 3e-4 / 4e-4)."""
    dual_clip: float = 0.0
    """PPO dual clip: for negative advantages the objective is bounded below by dual_clip x A
    (> 1, e.g. 3); 0 turns it off."""
    loss_aggregation: Literal["token", "sequence", "constant"] = "token"
    """token: mean over all tokens of the global batch (DAPO). sequence: mean over each sequence's
    tokens, then over sequences (GRPO). constant: token sum / (sequences x rollout.max_new_tokens)
    (Dr. GRPO, with std_normalization=none)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the batch is full."""
    dynamic_sampling_rounds: int = 4
    """Extra sampling rounds at most per step; a batch still short is filled with dropped groups."""
    mismatch_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    """Weight each token's loss by p_train / p_rollout of the sampled tokens (per token or per
    sequence), truncated at mismatch_threshold or masked outside [1/threshold, threshold]."""
    mismatch_threshold: float = 2.0
    beta: float = 0.1
    """DPO: the strength of the implicit KL constraint to the reference (TRL's beta)."""
    preference_loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """DPO: sigmoid -log s(beta x) (Rafailov et al.), ipo (x - 1/(2 beta))^2 on per-token mean
    log-ratios (Azar et al.), or hinge max(0, 1 - beta x) (SLiC); x is the chosen minus the
    rejected log-ratio to the reference."""
    label_smoothing: float = 0.0
    """DPO sigmoid loss: the assumed share of flipped labels e (conservative DPO):
    -(1 - e) log s(beta x) - e log s(-beta x)."""
    average_logprobs: Optional[bool] = None
    """DPO: log-ratios as per-token means over the response instead of sums; unset (none) means
    true for ipo and false otherwise."""
    sft_loss_weight: float = 0.0
    """DPO: add this times the mean NLL of the chosen responses' tokens (TRL's rpo_alpha)."""
    precompute_reference: bool = False
    """DPO: compute the reference log-probs of every pair once before training (cached in the run
    directory) and free the reference model."""
    center_rewards_coefficient: float = 0.0
    """Reward model: add this times mean((r_c + r_r)^2), keeping scores centered at 0 (TRL's;
    0.01 is a common value)."""


@dataclass(kw_only=True)
class RolloutConfig:
    """Generation with megatron-core's dynamic inference engine on the training model."""

    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 0.0
    """Nucleus sampling; 0 turns it off. Cannot be combined with top_k."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 turns it off."""
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    """Stop strings (comma-separated on the command line); eos always stops."""
    seed: int = 0
    """Sampling seed; step s of a run samples with seed + s (and the data-parallel rank)."""
    max_sequence_length: int = 256
    """Longest prompt + completion the engine's KV cache takes."""
    max_requests: int = 512
    """Requests decoded together (continuous batching); more wait for a free slot."""
    max_tokens: int = 8192
    """Tokens per engine step (prefill chunks included)."""
    kv_cache_gb: float = 0.25
    block_size_tokens: int = 32
    """KV cache block size (paged attention)."""

    def validate(self):
        _positive(self, "n", "max_new_tokens", "max_requests", "max_tokens", "block_size_tokens")
        if self.top_k and self.top_p:
            raise ConfigError("rollout.top_k and rollout.top_p cannot both be set; pick one (0 turns one off).")
        if not 0.0 <= self.top_p <= 1.0 or self.temperature <= 0:
            raise ConfigError("rollout.top_p must be in [0, 1] and rollout.temperature positive.")


@dataclass(kw_only=True)
class RewardsConfig:
    fn: str = "exact_match"
    """'exact_match', 'math' (math-verify) or 'package.module:function' (see megatron_rl/rewards)."""
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
    model: str = ""
    """rewards.fn=reward_model: a reward model, our checkpoint (algorithm.name=rm) or a Hugging
    Face *ForSequenceClassification directory; it runs in the policy's parallel layout."""
    val_fn: str = ""
    """The reward of validation (val/accuracy, val/reward_mean); empty means rewards.fn."""


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = 100
    seed: int = 1234
    eval_every: int = 50
    """Evaluate every N steps (and at the end); 0 means only at the end."""
    eval_generate: bool = True
    """Also decode the validation prompts greedily and report val/accuracy (exact match)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """'auto' is bf16 on GPU and fp32 on CPU."""
    recompute: Literal["none", "selective", "full"] = "none"
    threads: int = 0
    """CPU threads of each process (torch.set_num_threads); a run's numbers depend on it on the
    CPU, so the tiny recipes pin it. 0 leaves torch's default (OMP_NUM_THREADS)."""
    """Activation recompute: 'selective' recomputes attention's core, 'full' each layer in the backward."""


@dataclass(kw_only=True)
class FP8Config:
    """FP8 GEMMs through Transformer Engine (GPUs only; megatron-core's fp8_* settings)."""

    format: Literal["off", "e4m3", "hybrid"] = "off"
    """'e4m3' everywhere, or 'hybrid' (e4m3 forward, e5m2 gradients); 'off': bf16."""
    recipe: Literal["tensorwise", "delayed", "blockwise", "mxfp8"] = "tensorwise"
    """Scaling: per-tensor current ('tensorwise', Hopper and Blackwell), per-tensor from an amax
    history ('delayed'), 128-element blocks ('blockwise', Hopper, CUDA >= 12.9) or MXFP8's 32-element
    blocks ('mxfp8', Blackwell only)."""
    bf16_first_layers: int = 0
    """Transformer layers at the start kept in bf16 (not with recipe=delayed)."""
    bf16_last_layers: int = 0
    """Transformer layers at the end kept in bf16 (not with recipe=delayed)."""
    param: bool = False
    """Keep the GEMM weights themselves in FP8 (less memory; megatron's fp8_param)."""

    def validate(self):
        if self.format == "off":
            return
        if min(self.bf16_first_layers, self.bf16_last_layers) < 0:
            raise ConfigError("fp8.bf16_first_layers and fp8.bf16_last_layers must be >= 0.")
        if self.recipe == "delayed" and (self.bf16_first_layers or self.bf16_last_layers):
            raise ConfigError("fp8.recipe=delayed cannot keep the first or last layers in bf16 (megatron-core refuses "
                              "it): use fp8.recipe=tensorwise or blockwise, or set fp8.bf16_first_layers and "
                              "fp8.bf16_last_layers to 0.")


@dataclass(kw_only=True)
class CheckpointConfig:
    save_every: int = 0
    """Save every N steps (and always at the end); 0 means only at the end."""
    resume: bool = False
    """Continue from the latest complete checkpoint in the run directory."""
    load: str = ""
    """Start from the model weights of this checkpoint directory (any TP/PP layout), or of the
    latest checkpoint of this run directory."""
    save: bool = True
    keep: int = 2
    """How many recent checkpoints to keep; 0 keeps all."""
    export_hf: bool = False
    """At the end, also write the model as a Hugging Face directory to <run_dir>/hf."""


@dataclass(kw_only=True)
class LoggingConfig:
    run_dir: str = ""
    """Where outputs go; empty means runs/<recipe>."""
    tensorboard: bool = True
    progress: bool = True
    """A progress bar with ETA on the console of rank 0."""
    wandb_project: str = ""
    """Weights & Biases project to log to (empty: off). Needs `pip install wandb`."""
    wandb_run: str = ""
    """The W&B run's name (empty: the run directory's name)."""
    wandb_entity: str = ""
    """W&B team or user (empty: your default)."""
    wandb_mode: Literal["online", "offline"] = "online"
    """offline writes the run under <run_dir>/wandb for a later `wandb sync`."""


@dataclass(kw_only=True)
class ProfilingConfig:
    nvtx: bool = False
    """Wrap phases in nvtx ranges (for nsys)."""
    nsys_start: int = -1
    """First step of the profiling window: torch.cuda.profiler capture starts there (run under `nsys
    --capture-range=cudaProfilerApi --capture-range-end=stop`), and the torch profiler records."""
    nsys_end: int = -1
    """The step where the window closes (-1: one step after nsys_start)."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """The ranks that profile (the others run unprofiled)."""
    torch_profiler: bool = False
    """Record the window with torch.profiler into <run_dir>/profile/*.pt.trace.json (TensorBoard and
    Chrome/Perfetto open it), on any device; without a window, step 1 (after a warm-up step)."""

    def window(self) -> tuple[int, int]:
        """[start, end) of the profiling window in steps; (-1, -1) when nothing is profiled."""
        start = self.nsys_start if self.nsys_start >= 0 else (1 if self.torch_profiler else -1)
        if start < 0:
            return -1, -1
        return start, self.nsys_end if self.nsys_end > start else start + 1


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
    train: TrainConfig = field(default_factory=TrainConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def validate(self, world_size: int = 1):
        """Check everything that can be checked before a model is built."""
        self.model.validate()
        self.parallel.validate(world_size, self.model)
        self.optimizer.validate()
        self.data.validate(self.parallel.data_parallel_size(world_size), uses_global_batch=self.algorithm.name != "grpo")
        self._validate_heads_and_rewards()
        self.fp8.validate()
        p = self.parallel
        split = (2 * p.cp if p.cp > 1 else 1) * (p.tp if p.sp else 1)
        if self.data.seq_length % split:
            raise ConfigError(
                f"data.seq_length={self.data.seq_length} must be divisible by {split}: 2 chunks per context-parallel "
                f"rank times tp with sequence parallelism; change data.seq_length or parallel.cp/tp.")
        self._validate_packing()
        if self.algorithm.name == "grpo":
            self._validate_grpo(self.parallel.data_parallel_size(world_size))
        if self.algorithm.name == "dpo":
            self._validate_dpo()
        _positive(self.train, "max_steps")
        if self.train.threads < 0:
            raise ConfigError(f"train.threads={self.train.threads} must be >= 0 (0: torch's default).")
        if self.train.eval_every < 0 or self.checkpoint.save_every < 0:
            raise ConfigError("train.eval_every and checkpoint.save_every must be >= 0 (0 means at the end only).")
        if self.logging.wandb_project:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("logging.wandb_project needs Weights & Biases: pip install wandb (or pip install -e "
                                  "'.[wandb]'), or leave logging.wandb_project empty.")
        return self

    def _validate_grpo(self, dp: int):
        a, r = self.algorithm, self.rollout
        r.validate()
        _positive(a, "prompts_per_step", "minibatches", "epochs")
        samples = a.prompts_per_step * r.n
        if a.prompts_per_step % dp or samples % (a.minibatches * self.data.micro_batch_size * dp):
            raise ConfigError(
                f"algorithm.prompts_per_step x rollout.n = {samples} samples must split into algorithm.minibatches="
                f"{a.minibatches} minibatches of whole microbatches (data.micro_batch_size={self.data.micro_batch_size})"
                f" on each of {dp} data-parallel ranks, and prompts_per_step into the ranks; adjust them.")
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
        if a.router_replay and not self.model.num_experts:
            raise ConfigError("algorithm.router_replay=true needs an MoE model (model.num_experts > 0).")
        if self.parallel.cp > 1 and (a.ratio_level == "sequence" or a.mismatch_correction.startswith("sequence")):
            raise ConfigError("sequence-level ratios (algorithm.ratio_level=sequence, sequence mismatch corrections) "
                              "need each sequence whole on one rank; use parallel.cp=1 with them.")
        if a.advantage_estimator == "gdpo" and a.baseline != "mean":
            raise ConfigError("algorithm.advantage_estimator=gdpo normalizes each component by its group mean and std; "
                              "set algorithm.baseline=mean.")
        if a.mismatch_threshold <= 1:
            raise ConfigError(f"algorithm.mismatch_threshold={a.mismatch_threshold} must be > 1.")
        if not 0 <= self.rewards.overlong_buffer < r.max_new_tokens:
            raise ConfigError(f"rewards.overlong_buffer={self.rewards.overlong_buffer} must be in [0, "
                              f"rollout.max_new_tokens={r.max_new_tokens}).")

    def _validate_packing(self):
        budget, p = self.data.max_tokens_per_microbatch, self.parallel
        if not budget:
            return
        if self.algorithm.name == "rm":
            raise ConfigError("data.max_tokens_per_microbatch packs SFT, GRPO and DPO microbatches; reward models are "
                              "not packed yet: set it to 0 with algorithm.name=rm.")
        longest = -(-self.data.seq_length // 16) * 16 * (2 if self.algorithm.name == "dpo" else 1)
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
            from megatron_rl.data.arithmetic import NEGATIVES

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
        if not 0 <= a.label_smoothing < 0.5 or (a.label_smoothing and a.preference_loss != "sigmoid"):
            raise ConfigError(f"algorithm.label_smoothing={a.label_smoothing} must be in [0, 0.5) and needs "
                              f"algorithm.preference_loss=sigmoid.")
        if a.sft_loss_weight < 0:
            raise ConfigError(f"algorithm.sft_loss_weight={a.sft_loss_weight} must be >= 0.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _positive(obj, *names):
    section = _SECTION_OF.get(type(obj).__name__, type(obj).__name__)
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{section}.{name}={value} must be positive.")


_SECTION_OF = {f.type if isinstance(f.type, str) else f.type.__name__: f.name
               for f in dataclasses.fields(Config) if f.name != "recipe"}


# --- overrides -------------------------------------------------------------------------------


# Keys that moved, with what replaced them.
MOVED = {"train.fp8": "FP8 has its own section now; use fp8.format (with fp8.recipe, fp8.bf16_first_layers, "
                      "fp8.bf16_last_layers, fp8.param)."}


def all_keys(cfg: Config) -> list[str]:
    keys = []
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(value)]
    return keys


def _parse_value(text: str, annotation, key: str):
    """Turn override text into the field's type, or raise a ConfigError naming the key."""
    hint = annotation
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        hint, origin = args[0], typing.get_origin(args[0])
    if origin is list:
        (item_type,) = typing.get_args(hint) or (str,)
        return [_parse_value(item.strip(), item_type, key) for item in text.split(",") if item.strip()]
    if origin is dict:  # name:number,name:number
        out = {}
        for item in filter(None, (i.strip() for i in text.split(","))):
            name, _, value = item.partition(":")
            try:
                out[name.strip()] = float(value)
            except ValueError:
                raise ConfigError(f"{key}={text!r}: write name:number pairs separated by commas.") from None
        return out
    if origin is Literal:
        choices = typing.get_args(hint)
        if text not in choices:
            raise ConfigError(f"{key}={text!r} is not one of {', '.join(map(repr, choices))}.")
        return text
    if hint is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={text!r} is not a boolean; use true or false.")
    if hint in (int, float):
        try:
            number = float(text) if hint is float else int(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r} is not {'an integer' if hint is int else 'a number'}.") from None
        return number
    return text


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `section.field=value` strings in order; unknown keys name the closest valid ones."""
    hints = {name: typing.get_type_hints(type(getattr(cfg, name)))
             for name in (f.name for f in dataclasses.fields(cfg)) if name != "recipe"}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value.")
        key, text = item.split("=", 1)
        section, _, name = key.partition(".")
        if key in MOVED:
            raise ConfigError(f"{key} is gone: {MOVED[key]}")
        if section not in hints or name not in hints[section]:
            close = difflib.get_close_matches(key, all_keys(cfg), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(close)}?" if close else " Run with --print-config to see all keys."
            raise ConfigError(f"unknown config key {key!r}.{hint}")
        setattr(getattr(cfg, section), name, _parse_value(text, hints[section][name], key))
    return cfg


def from_dict(data: dict) -> Config:
    """Rebuild a Config from to_dict() output (as saved in a run directory)."""
    cfg = Config(recipe=data.get("recipe", ""))
    for section, values in data.items():
        if section != "recipe":
            for name, value in values.items():
                setattr(getattr(cfg, section), name, value)
    return cfg
