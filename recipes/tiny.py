"""Tiny models on the built-in arithmetic task: fast on a 2-core CPU, used by the demo and tests."""

import dataclasses

from megatron_rl.config import (AlgorithmConfig, CheckpointConfig, Config, DataConfig, DistillConfig, ModelConfig,
                                OptimizerConfig, PPOConfig, RolloutConfig, SchedulerConfig, TrainConfig)

from . import register
from .common import with_lora

THREADS = 1
"""CPU threads the tiny recipes run with: their end points depend on it, and on the machine's GEMM
kernels (with one thread the old 800-step tiny_sft reached 63% held out on one machine and 35% on
another; the 2000-step one reaches 35-74% on three seeds), and the test suite runs one per process."""


def tiny_model() -> ModelConfig:
    return ModelConfig(family="llama", num_layers=2, hidden_size=128, ffn_hidden_size=512,
                       num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


@register
def tiny_sft() -> Config:
    """SFT of a 0.4M-parameter Llama-style model from scratch on 2-digit addition, from imperfect demonstrations.

    45% of the training responses are off by one (data.noise), as demonstrations from a weak model
    might be: the model learns addition but also the error, and greedy decoding gets a third to three
    quarters of the held-out problems right (73.6%, 46.1%, 35.2% on train.seed = data.seed = 0, 1, 2;
    depending on the machine too).
    tiny_grpo then corrects it with a verifiable reward. The model learns the answer's last digit late:
    after 800 steps it can still be near chance there (9% held out), so it trains 2000.
    """
    return Config(
        model=tiny_model(),
        data=DataConfig(task="arithmetic", digits=2, seq_length=16, micro_batch_size=32,
                        global_batch_size=64, num_train=50000, num_val=512, noise=0.45),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, weight_decay=0.0, clip_grad=1.0),
        scheduler=SchedulerConfig(warmup_steps=50, decay="cosine"),
        train=TrainConfig(max_steps=2000, eval_every=500, threads=THREADS),
    )


@register
def tiny_sft_muon() -> Config:
    """tiny_sft with Muon (optimizer.name=muon): orthogonalized momentum for the hidden layers' matrices,
    Adam for the embedding, output layer and norms, at tiny_sft's learning rate (Muon's update is scaled
    to AdamW's RMS: optimizer.muon_lr_scale=match_rms_adamw)."""
    cfg = tiny_sft()
    cfg.optimizer = dataclasses.replace(cfg.optimizer, name="muon")
    return cfg


def _sft_of(model: ModelConfig) -> Config:
    """tiny_sft with another model, 800 steps."""
    cfg = tiny_sft()
    cfg.model = model
    cfg.train.max_steps, cfg.train.eval_every = 800, 200
    return cfg


@register
def tiny_grpo() -> Config:
    """GRPO on 2-digit addition from the tiny_sft run's final checkpoint (run tiny_sft first).

    Exact-match reward against the true sum; 32 prompts x 8 samples per step. Raises held-out
    greedy accuracy well above tiny_sft's, whose demonstrations were partly wrong.
    """
    return Config(
        model=tiny_model(),
        data=DataConfig(task="arithmetic", digits=2, seq_length=16, micro_batch_size=64, num_train=50000,
                        num_val=512, noise=0.45),
        algorithm=AlgorithmConfig(name="grpo", prompts_per_step=32, minibatches=1, clip_low=0.2, clip_high=0.2),
        rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=5, max_sequence_length=32, max_requests=512),
        optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5, beta2=0.999, clip_grad=1.0),
        scheduler=SchedulerConfig(warmup_steps=0, decay="cosine"),
        train=TrainConfig(max_steps=100, eval_every=20, threads=THREADS),
        checkpoint=CheckpointConfig(load="runs/tiny_sft"),
    )


def _tiny_variant(**algorithm) -> Config:
    """tiny_grpo with some algorithm fields changed."""
    cfg = tiny_grpo()
    cfg.algorithm = dataclasses.replace(cfg.algorithm, **algorithm)  # a misspelled field is a TypeError
    return cfg


@register
def tiny_dapo() -> Config:
    """DAPO on the tiny task: clip-higher, token-level loss, dynamic sampling, overlong penalty."""
    cfg = _tiny_variant(clip_low=0.2, clip_high=0.28, loss_aggregation="token", dynamic_sampling=True)
    cfg.rewards.overlong_buffer = 2
    return cfg


@register
def tiny_gspo() -> Config:
    """GSPO on the tiny task: sequence-level importance ratios with GSPO's narrow clip range."""
    return _tiny_variant(ratio_level="sequence", loss_aggregation="sequence", clip_low=3e-4, clip_high=4e-4)


@register
def tiny_drgrpo() -> Config:
    """Dr. GRPO on the tiny task: no std scaling, loss normalized by a constant (max length)."""
    return _tiny_variant(std_normalization="none", loss_aggregation="constant")


@register
def tiny_cispo() -> Config:
    """CISPO on the tiny task: clipped importance weights as stop-gradient coefficients."""
    return _tiny_variant(policy_loss="cispo", clip_low=1.0, clip_high=0.28)


@register
def tiny_gdpo() -> Config:
    """GDPO on the tiny task: 'correct' and 'digits' rewards normalized per group, then weighted."""
    cfg = _tiny_variant(advantage_estimator="gdpo")
    cfg.rewards.fn = "exact_match_parts"
    cfg.rewards.weights = {"correct": 1.0, "digits": 0.2}
    return cfg


@register
def tiny_rloo() -> Config:
    """RLOO on the tiny task: the leave-one-out baseline without std scaling."""
    return _tiny_variant(advantage_estimator="rloo")


@register
def tiny_reinforce_pp() -> Config:
    """REINFORCE++ with a baseline on the tiny task: the KL to tiny_sft's policy folded into each token's
    reward, advantages whitened over the global batch's tokens."""
    return _tiny_variant(advantage_estimator="reinforce_pp", kl_coef=0.01)


@register
def tiny_ppo() -> Config:
    """PPO with a critic on the tiny task, from tiny_sft's checkpoint: the critic starts from the same
    weights with a fresh value head and learns alone for the first steps; GAE advantages per token."""
    cfg = tiny_grpo()
    cfg.algorithm.name = "ppo"
    cfg.ppo = PPOConfig(critic_lr=1e-3, critic_warmup_steps=2)
    return cfg


@register
def tiny_grpo_is() -> Config:
    """GRPO with rollout/train mismatch correction: truncated per-token importance weights."""
    return _tiny_variant(mismatch_correction="token_truncate", mismatch_threshold=2.0)


@register
def tiny_grpo_top_p() -> Config:
    """GRPO sampling from the nucleus (top_p=0.9): training replays each token's kept set, so the policy
    gradient is taken on the distribution the tokens were drawn from (rollout/filtered_logprob_gap: how
    far that is from the full one)."""
    cfg = tiny_grpo()
    cfg.rollout = dataclasses.replace(cfg.rollout, top_p=0.9)
    return cfg


@register
def tiny_grpo_async() -> Config:
    """tiny_grpo disaggregated and one step off-policy: run with torchrun --nproc_per_node 2. Rank 1 only
    generates (parallel.rollout_ranks=1), rank 0 only trains; rank 1 samples the next batch with the
    weights it has while rank 0 trains on the last one (algorithm.max_staleness=1), and the loss corrects
    for it with AReaL's decoupled objective (algorithm.off_policy=decoupled)."""
    cfg = _tiny_variant(max_staleness=1, off_policy="decoupled")
    cfg.parallel.rollout_ranks = 1
    return cfg


def tiny_moe_model() -> ModelConfig:
    """Qwen3-MoE-shaped: q/k norms, 8 experts of which each token uses 2."""
    return ModelConfig(family="qwen", num_layers=2, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
                       num_query_groups=2, qk_layernorm=True, max_position_embeddings=64, num_experts=8,
                       moe_ffn_hidden_size=128, moe_topk=2, moe_router_dtype="fp32", moe_capacity_factor=0.0,
                       moe_aux_loss_type="aux_loss", moe_aux_loss_coeff=1e-3)


@register
def tiny_moe_sft() -> Config:
    """tiny_sft with a 1M-parameter Qwen3-MoE-shaped model (8 experts, top-2): tiny_moe_grpo's start."""
    return _sft_of(tiny_moe_model())


@register
def tiny_moe_grpo() -> Config:
    """GRPO of the tiny MoE model from tiny_moe_sft's checkpoint, with rollout router replay (R3):
    the experts chosen in the rollout are used in every training forward and backward.

    Router settings RL users tune are model fields: moe_topk, moe_router_dtype, moe_capacity_factor
    (0: no token dropping) and the aux loss (off here: replayed routing does not follow it).
    """
    cfg = tiny_grpo()
    cfg.model = tiny_moe_model()
    cfg.model.moe_aux_loss_type, cfg.model.moe_aux_loss_coeff = "none", 0.0
    cfg.algorithm.router_replay = True
    cfg.checkpoint.load = "runs/tiny_moe_sft"
    cfg.train.max_steps, cfg.train.eval_every = 30, 10
    return cfg


@register
def tiny_dpo() -> Config:
    """DPO of tiny_sft (run it first) on 2-digit addition pairs: chosen the true sum, rejected tiny_sft's
    typical error (mostly off by one, as its demonstrations were), with an SFT term on the chosen.

    The starting checkpoint is also the reference. Plain DPO (algorithm.sft_loss_weight=0) ranks the
    pairs but pushes the chosen answers' likelihood down with the rejected ones', and greedy accuracy
    falls (likelihood displacement); the SFT term (RPO, weight 1 as Pang et al. use) keeps it up.
    """
    return Config(
        model=tiny_model(),
        data=DataConfig(task="arithmetic", digits=2, seq_length=16, micro_batch_size=32, global_batch_size=64,
                        num_train=20000, num_val=512, noise=0.45,
                        negatives={"plus1": 0.7, "minus1": 0.1, "plus10": 0.1, "random": 0.1}),
        algorithm=AlgorithmConfig(name="dpo", beta=0.1, sft_loss_weight=1.0),
        rollout=RolloutConfig(max_new_tokens=5, max_sequence_length=32),
        optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5, beta2=0.999, clip_grad=1.0),
        scheduler=SchedulerConfig(warmup_steps=0, decay="cosine"),
        train=TrainConfig(max_steps=100, eval_every=20, threads=THREADS),
        checkpoint=CheckpointConfig(load="runs/tiny_sft"),
    )


@register
def tiny_rm() -> Config:
    """A reward model of 2-digit addition: tiny_sft's model shape with 6 layers instead of 2 and a scalar head,
    trained from scratch for 8000 steps with weight decay 1.0 on pairs whose rejected answers mix +-1, +-10,
    random numbers and tiny_sft's own wrong samples (run tiny_sft first), so that no shortcut (the last digit
    alone, say) ranks them. With 2 layers the +-10 pairs stay near chance (the tens digit needs the carry: the
    whole sum); started from tiny_sft's 2000-step checkpoint (the language-model head dropped), it stays at
    53-72% after 800 steps: that model's last-digit position only predicts eos. Without weight decay the model
    memorizes its training problems and held-out accuracy depends much more on the seed (README).

    The tokenizer pads with eos (data.pad_token), so the score is read at the answer's last digit (as
    transformers reads it: the last token that is not padding), where two layers can check it; read at
    the eos token, the tiny model stays near chance. Validation reports pairwise accuracy per kind of
    wrong answer; val/accuracy_policy is the reward model's agreement with exact match on the policy's
    own samples.
    """
    return Config(
        model=ModelConfig(**{**vars(tiny_model()), "head": "score", "num_layers": 6}),
        data=DataConfig(task="arithmetic", digits=2, seq_length=16, micro_batch_size=32, global_batch_size=64,
                        num_train=20000, num_val=512, noise=0.45, pad_token="eos",
                        negatives={"plus1": 0.2, "minus1": 0.15, "plus10": 0.1, "minus10": 0.1, "random": 0.15,
                                   "policy": 0.3}, negatives_from="runs/tiny_sft"),
        algorithm=AlgorithmConfig(name="rm"),
        rollout=RolloutConfig(max_new_tokens=5, max_sequence_length=32),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, clip_grad=1.0, weight_decay=1.0),
        scheduler=SchedulerConfig(warmup_steps=20, decay="cosine"),
        train=TrainConfig(max_steps=8000, eval_every=500, threads=THREADS),
    )


@register
def tiny_grpo_rm() -> Config:
    """GRPO of tiny_sft against tiny_rm's scores (run both first): the learned reward replaces exact
    match in training; validation still measures exact match (rewards.val_fn)."""
    cfg = tiny_grpo()
    cfg.rewards.fn, cfg.rewards.model, cfg.rewards.val_fn = "reward_model", "runs/tiny_rm", "exact_match"
    return cfg


@register
def tiny_tool_sft() -> Config:
    """A code tool where it pays: products of two 3-digit numbers, which the tiny model cannot work out in
    its head. SFT from scratch on tool-use episodes ('<code>print(a*b)</code>', the tool's
    '<result>...</result>' out of the loss, then the answer) from a demonstrator who, when the first
    operand is 500 or more, skips the tool 80% of the time and answers an estimate (the product rounded
    to the hundreds): the model learns the tool, and to skip it on large problems. The character
    vocabulary gains the tool's syntax."""
    cfg = tiny_sft()
    cfg.model.max_position_embeddings = 128
    cfg.data.ops, cfg.data.digits, cfg.data.tool, cfg.data.noise, cfg.data.seq_length = "*", 3, "code", 0.8, 80
    return cfg


@register
def tiny_tool_grpo() -> Config:
    """GRPO of tiny_tool_sft with the code tool (rewards.fn=code, run tiny_tool_sft first): each episode is
    a call, the sandboxed program's result, and the answer (rollout.max_turns=2), rewarded by exact
    match. Evaluate with the tool switched off: tools/eval.py --reward code_off."""
    cfg = tiny_grpo()
    cfg.model.max_position_embeddings = 128
    cfg.data.ops, cfg.data.digits, cfg.data.tool, cfg.data.seq_length = "*", 3, "code", 80
    cfg.rewards.fn, cfg.rewards.workers = "code", 2
    cfg.rollout.max_turns, cfg.rollout.max_new_tokens, cfg.rollout.max_sequence_length = 2, 32, 128
    cfg.checkpoint.load = "runs/tiny_tool_sft"
    return cfg


def _puzzle(cfg: Config) -> Config:
    """The sliding-puzzle task on cfg: 3 x 3 boards 6 random moves from solved (39 boards; up to 8 moves
    with a detour, up to about 260 characters an episode)."""
    cfg.model.max_position_embeddings = 320
    cfg.data.task, cfg.data.board_size, cfg.data.scramble, cfg.data.seq_length = "sliding_puzzle", 3, 6, 288
    cfg.data.num_val = 64
    return cfg


@register
def tiny_puzzle_sft() -> Config:
    """SFT from scratch on sliding-puzzle demonstrations: each move as <action>dir</action>, the board the
    environment answers out of the loss; 20% of the moves of a demonstration may be a random detour
    (at most one per episode), the solution going on from there."""
    cfg = _puzzle(tiny_sft())
    cfg.data.noise = 0.2
    cfg.train.max_steps = 600
    return cfg


@register
def tiny_puzzle_grpo() -> Config:
    """GRPO of tiny_puzzle_sft in the sliding-puzzle environment (run tiny_puzzle_sft first): 40 steps,
    episodes of up to 10 moves, reward 1 when solved; val/accuracy is the greedy solve rate."""
    cfg = _puzzle(tiny_grpo())
    cfg.rewards.fn, cfg.rewards.workers = "sliding_puzzle", 2
    cfg.rollout.max_turns, cfg.rollout.max_new_tokens, cfg.rollout.max_sequence_length = 10, 24, 320
    cfg.train.max_steps, cfg.train.eval_every = 40, 10
    cfg.checkpoint.load = "runs/tiny_puzzle_sft"
    return cfg


@register
def tiny_teacher() -> Config:
    """tiny_sft's model trained further on clean demonstrations (no wrong answers): the teacher of
    tiny_distill (run tiny_sft first)."""
    cfg = tiny_sft()
    cfg.data.noise = 0.0
    cfg.optimizer.lr, cfg.optimizer.min_lr = 1e-3, 1e-4
    cfg.scheduler.warmup_steps = 0
    cfg.train.max_steps, cfg.train.eval_every = 300, 100
    cfg.checkpoint.load = "runs/tiny_sft"
    return cfg


@register
def tiny_bpe_teacher() -> Config:
    """A teacher with another tokenizer, for tiny_xtoken: tiny_sft's model shape trained from scratch on clean
    demonstrations, tokenized by a 20-token byte-level BPE trained on the task's own training split (its 5
    merges are the most frequent digit pairs, 10 to 14, so '146' is '14' '6')."""
    cfg = tiny_sft()
    cfg.data.tokenizer, cfg.data.noise = "bpe:20", 0.0
    cfg.train.max_steps, cfg.train.eval_every = 3000, 500
    return cfg


@register
def tiny_distill() -> Config:
    """On-policy distillation of tiny_teacher into tiny_sft's model (run both first): the student samples
    4 answers to each of 32 prompts per step and learns the teacher's next-token distribution on them
    (forward KL on the teacher's top 8 of its 15 tokens)."""
    cfg = tiny_grpo()
    cfg.algorithm = AlgorithmConfig(name="distill", prompts_per_step=32)
    cfg.rollout.n = 4
    cfg.distill = DistillConfig(teacher="runs/tiny_teacher", topk=8)
    cfg.optimizer.lr, cfg.optimizer.min_lr = 1e-3, 1e-4
    cfg.train.max_steps = 100
    return cfg


@register
def tiny_xtoken() -> Config:
    """Cross-tokenizer on-policy distillation of tiny_bpe_teacher (a 64-token BPE) into tiny_sft's character
    model (run both first): both tokenize each sampled answer, tokens are grouped into chunks ending where
    both have a boundary, and the student matches the teacher's likelihood of each chunk (ALM)."""
    cfg = tiny_distill()
    cfg.distill = DistillConfig(teacher="runs/tiny_bpe_teacher", cross_tokenizer=True)
    return cfg


@register
def tiny_mopd_sft() -> Config:
    """tiny_sft on addition and subtraction ('a-b=' with a >= b; '-' joins the vocabulary), 6000 steps: the
    student of tiny_mopd, and the start of its two teachers. (After 800 steps it has not learned the answer's
    last digit yet: its log-probs there are near uniform, and a sampled token's teacher log-prob tells it too
    little to learn that in a hundred steps.)"""
    cfg = tiny_sft()
    cfg.data.ops = "+-"
    cfg.train.max_steps, cfg.train.eval_every = 6000, 1000
    return cfg


def _op_teacher(op: str) -> Config:
    """tiny_mopd_sft's model, 2000 more steps on clean problems of one operation (it forgets the other)."""
    cfg = tiny_teacher()
    cfg.data.ops, cfg.data.train_ops = "+-", op
    cfg.train.max_steps, cfg.train.eval_every = 2000, 500
    cfg.checkpoint.load = "runs/tiny_mopd_sft"
    return cfg


@register
def tiny_teacher_add() -> Config:
    """tiny_mopd_sft's model trained further on clean additions only: tiny_mopd's teacher of addition."""
    return _op_teacher("+")


@register
def tiny_teacher_sub() -> Config:
    """tiny_mopd_sft's model trained further on clean subtractions only: tiny_mopd's teacher of subtraction."""
    return _op_teacher("-")


@register
def tiny_mopd() -> Config:
    """Multi-teacher on-policy distillation (run tiny_mopd_sft, tiny_teacher_add and tiny_teacher_sub first):
    each prompt's row names its operation's teacher; every sampled token's advantage is the teacher's
    log-prob minus the student's. Validation reports accuracy per operation (val/accuracy_add, _sub)."""
    cfg = tiny_distill()
    cfg.data.ops = "+-"
    cfg.distill = DistillConfig(teachers={"add": "runs/tiny_teacher_add", "sub": "runs/tiny_teacher_sub"})
    cfg.checkpoint.load = "runs/tiny_mopd_sft"
    cfg.optimizer.lr, cfg.optimizer.min_lr = 1e-4, 1e-5
    return cfg


def _with_lora(cfg: Config, lr: float) -> Config:
    """Rank-8 adapters (alpha 16), the learning rate decaying to a tenth."""
    return with_lora(cfg, rank=8, alpha=16, lr=lr, min_lr=lr / 10)


@register
def tiny_sft_lora() -> Config:
    """LoRA SFT of tiny_sft's model (run it first) on clean demonstrations: tiny_teacher with adapters."""
    return _with_lora(tiny_teacher(), 3e-3)


@register
def tiny_dpo_lora() -> Config:
    """tiny_dpo with LoRA: the reference is the model with its adapters off."""
    return _with_lora(tiny_dpo(), 1e-3)


@register
def tiny_grpo_lora() -> Config:
    """tiny_grpo with LoRA: rollouts on the model with its adapters, no merging."""
    return _with_lora(tiny_grpo(), 1e-3)


def tiny_nemotron_h_model() -> ModelConfig:
    """Nemotron-H-shaped hybrid: Mamba-2, attention, MLP and MoE layers (sigmoid router with expert
    bias and a shared expert, squared-ReLU MLPs, no rotary embeddings)."""
    return ModelConfig(family="nemotron_h", num_layers=6, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                       num_query_groups=2, head_dim=32, norm_epsilon=1e-5, activation="squared_relu",
                       max_position_embeddings=64, hybrid_pattern="M*M-ME", mamba_num_heads=8, mamba_head_dim=16,
                       mamba_num_groups=2, mamba_state_dim=16, mamba_chunk_size=16, num_experts=8,
                       moe_ffn_hidden_size=64, moe_shared_ffn_hidden_size=128, moe_topk=2, moe_score_function="sigmoid",
                       moe_expert_bias=True, moe_router_dtype="fp32", moe_capacity_factor=0.0)


@register
def tiny_nemotron_h_sft() -> Config:
    """tiny_sft with a Nemotron-H-shaped hybrid (Mamba-2, attention, MLP and MoE layers)."""
    return _sft_of(tiny_nemotron_h_model())


@register
def tiny_nemotron_h_grpo() -> Config:
    """GRPO of the tiny hybrid from tiny_nemotron_h_sft's checkpoint, rolled out with Mamba states in the
    engine, with router replay on its MoE layer."""
    cfg = tiny_grpo()
    cfg.model = tiny_nemotron_h_model()
    cfg.algorithm.router_replay = True
    cfg.checkpoint.load = "runs/tiny_nemotron_h_sft"
    return cfg


def tiny_deepseek_model() -> ModelConfig:
    """DeepSeek-V3-shaped: multi-latent attention with query compression, a dense first layer, then MoE
    layers with a sigmoid router (expert bias) and a shared expert."""
    return ModelConfig(family="deepseek", num_layers=3, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                       head_dim=32, max_position_embeddings=64, qk_layernorm=True, multi_latent_attention=True,
                       q_lora_rank=64, kv_lora_rank=32, qk_head_dim=16, qk_pos_head_dim=32, v_head_dim=32,
                       num_experts=8, moe_ffn_hidden_size=64, moe_shared_ffn_hidden_size=64, moe_first_dense_layers=1,
                       moe_topk=2, moe_score_function="sigmoid", moe_expert_bias=True, moe_router_dtype="fp32",
                       moe_capacity_factor=0.0)


@register
def tiny_deepseek_sft() -> Config:
    """tiny_sft with a DeepSeek-V3-shaped model (multi-latent attention, sigmoid-routed MoE): held-out
    accuracy 20-43% after its 800 steps (seeds 0-2; the end point swings with training's rounding),
    tiny_deepseek_grpo's start."""
    return _sft_of(tiny_deepseek_model())


@register
def tiny_deepseek_grpo() -> Config:
    """GRPO of the tiny DeepSeek from tiny_deepseek_sft's checkpoint: rollouts from the latent KV
    cache, with router replay. Held-out accuracy +5 to +26 points in 20 steps (seeds 0-2, README)."""
    cfg = tiny_grpo()
    cfg.model = tiny_deepseek_model()
    cfg.rollout.block_size_tokens = 64
    cfg.algorithm.router_replay = True
    cfg.checkpoint.load = "runs/tiny_deepseek_sft"
    return cfg
