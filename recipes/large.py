"""RL recipes for 100B-class models on H100 clusters (GRPO family, math with verifiable rewards).

Each sets the architecture (so that `python tools/plan.py --recipe NAME` checks the layout without
the checkpoint) and the parallel layout its size needs. For a run, point model.hf_path at the
Hugging Face checkpoint (its config.json then sets the model section; weights and tokenizer come
from it) and data.train_path at a JSONL of {"prompt", "answer"} rows, then under Slurm:

    srun python train.py --recipe qwen3_235b_a22b_grpo model.hf_path=/ckpt/Qwen3-235B-A22B \\
        data.train_path=/data/math.jsonl

GB200 (NVL72, 186 GB per GPU): the same model fits on fewer, larger-memory GPUs; each recipe's
docstring gives the layout that `tools/plan.py --gpu gb200` accepts.
"""

from megatron_rl.config import (AlgorithmConfig, Config, DataConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                RewardsConfig, RolloutConfig, SchedulerConfig, TrainConfig)

from . import register


def _math_grpo(model: ModelConfig, parallel: ParallelConfig, prompts_per_step: int, max_requests: int,
               kv_cache_gb: float) -> Config:
    """DAPO-style GRPO on math problems: 1k-token prompts, 3k-token answers, 8 samples each."""
    return Config(
        model=model,
        parallel=parallel,
        data=DataConfig(task="", train_path="data/math/train.jsonl", seq_length=4096, micro_batch_size=1),
        algorithm=AlgorithmConfig(name="grpo", prompts_per_step=prompts_per_step, minibatches=4, clip_low=0.2,
                                  clip_high=0.28, loss_aggregation="token", dynamic_sampling=True),
        rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=3072, max_sequence_length=4224,
                              max_requests=max_requests, kv_cache_gb=kv_cache_gb),
        rewards=RewardsConfig(fn="math", overlong_buffer=512, workers=8),
        optimizer=OptimizerConfig(lr=1e-6, min_lr=1e-6, weight_decay=0.1, clip_grad=1.0, distributed=True),
        scheduler=SchedulerConfig(warmup_steps=10, decay="constant"),
        train=TrainConfig(max_steps=500, eval_every=25, precision="bf16", recompute="full"),
    )


def _qwen3_moe(layers, hidden, heads, experts_ffn) -> ModelConfig:
    return ModelConfig(family="qwen", num_layers=layers, hidden_size=hidden, ffn_hidden_size=3 * hidden,
                       num_attention_heads=heads, num_query_groups=4, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, qk_layernorm=True, rotary_base=1e6, num_experts=128,
                       moe_ffn_hidden_size=experts_ffn, moe_topk=8, moe_dispatcher="alltoall")


@register
def qwen3_30b_a3b_grpo() -> Config:
    """Qwen3-30B-A3B, GRPO on math: 2 nodes x 8 H100 (TP2 + SP, EP8, DP8).

    GB200: 2 x 4-GPU trays, the same layout at parallel.dp=4 algorithm.prompts_per_step=32.
    """
    return _math_grpo(_qwen3_moe(48, 2048, 32, 768),
                      ParallelConfig(tp=2, sp=True, ep=8, etp=1, dp=8), prompts_per_step=64, max_requests=64,
                      kv_cache_gb=8)


@register
def qwen3_235b_a22b_grpo() -> Config:
    """Qwen3-235B-A22B, GRPO on math: 16 nodes x 8 H100 (TP4 + SP, PP8 with 11/12/11 layers, EP8, DP4).

    GB200: 16 x 4-GPU trays: parallel.pp=4 parallel.first_stage_layers=23 parallel.last_stage_layers=23
    parallel.dp=4 with --world-size 64.
    """
    return _math_grpo(_qwen3_moe(94, 4096, 64, 1536),
                      ParallelConfig(tp=4, sp=True, pp=8, first_stage_layers=11, last_stage_layers=11, ep=8, etp=1,
                                     dp=4),
                      prompts_per_step=64, max_requests=32, kv_cache_gb=8)


@register
def deepseek_v3_grpo() -> Config:
    """DeepSeek-V3 (671B, MLA, 256 experts), GRPO on math: 32 nodes x 8 H100 (TP8 + SP, PP8 with
    7/8/6 layers, EP32, DP4), FP8 GEMMs where Transformer Engine is installed.

    GB200: 32 x 4-GPU trays (two NVL72 racks): parallel.tp=4 parallel.dp=4 parallel.ep=16 with
    --world-size 128.

    Not runnable yet: the rollout engine refuses multi-latent attention (megatron-core's dynamic
    engine needs its latent KV cache and FlashMLA for it); the planner sizes it already.
    """
    model = ModelConfig(
        family="deepseek", num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
        head_dim=128, vocab_size=129280, max_position_embeddings=163840, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_head_dim=64,
        v_head_dim=128, rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_position=4096,
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0, num_experts=256, moe_ffn_hidden_size=2048,
        moe_shared_ffn_hidden_size=2048, moe_first_dense_layers=3, moe_topk=8, moe_score_function="sigmoid",
        moe_expert_bias=True, moe_num_groups=8, moe_group_topk=4, moe_topk_scaling_factor=2.5,
        moe_dispatcher="alltoall")
    cfg = _math_grpo(model, ParallelConfig(tp=8, sp=True, pp=8, first_stage_layers=7, last_stage_layers=6, ep=32,
                                           etp=1, dp=4),
                     prompts_per_step=32, max_requests=16, kv_cache_gb=8)
    # FP8 (blockwise: H100; on GB200 fp8.recipe=mxfp8), rollouts through the same FP8 modules: the
    # rollout/training mismatch widens, so importance weights correct it
    cfg.fp8.format, cfg.fp8.recipe = "hybrid", "blockwise"
    cfg.algorithm.mismatch_correction = "token_truncate"
    return cfg


@register
def nemotron_grpo() -> Config:
    """Nemotron-4-340B (dense; LayerNorm1P, squared ReLU, partial rotary), GRPO on math: 24 nodes x 8
    H100 (TP8 + SP, PP12, DP2).

    GB200: 24 x 4-GPU trays: parallel.pp=6 parallel.dp=2 with --world-size 96.
    """
    model = ModelConfig(family="nemotron", num_layers=96, hidden_size=18432, ffn_hidden_size=73728,
                        num_attention_heads=96, num_query_groups=8, head_dim=192, vocab_size=256000,
                        normalization="LayerNorm", zero_centered_gamma=True, activation="squared_relu",
                        rotary_percent=0.5, norm_epsilon=1e-5, max_position_embeddings=4096)
    return _math_grpo(model, ParallelConfig(tp=8, sp=True, pp=12, dp=2), prompts_per_step=32, max_requests=32,
                      kv_cache_gb=4)
