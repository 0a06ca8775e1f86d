"""Model, optimizer and LR schedule from a Config: the one place a parallel layout becomes modules."""

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rl import platform
from megatron_rl.config import Config, ConfigError
from megatron_rl.training import lora


def compute_dtype(cfg: Config) -> torch.dtype:
    """'auto' is bf16 on GPU and fp32 on CPU."""
    precision = cfg.train.precision
    if precision == "auto":
        precision = platform.traits().default_precision
    return torch.bfloat16 if precision == "bf16" else torch.float32


@dataclass
class Trainee:
    """What a training loop works on: model chunks (one per virtual stage), optimizer, schedule."""

    model: list  # DDP-wrapped GPTModel per virtual pipeline stage on this rank
    optimizer: object
    scheduler: object
    config: object  # megatron TransformerConfig
    max_skipped_steps: int = 10  # non-finite steps in a row before the run stops (train.max_skipped_steps)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm, in all
    skipped_in_a_row: int = 0
    base: dict | None = None  # LoRA: the base the adapters are trained on ({'path', 'checksum'})

    def train(self):
        for chunk in self.model:
            chunk.train()

    def eval(self):
        for chunk in self.model:
            chunk.eval()


def build_model(cfg: Config, wrap_ddp: bool = True, meta: bool = False, adapters: bool = False):
    """GPTModel chunks for this rank's pipeline stage(s); DDP-wrapped for training. meta: shapes
    only (call under torch.device("meta"), for planning). adapters: LoRA's (lora.rank > 0), the base frozen."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from model_providers import get_family
    from model_providers.builder import Provider

    dtype = compute_dtype(cfg)
    platform.set_training_length(cfg.data.seq_length)  # CPU attention of long sequences
    get_family(cfg.model.family)  # an unknown family is a clear error before anything is built
    provider = Provider(cfg.model, cfg.parallel, dtype, fp8=cfg.fp8, recompute=cfg.train.recompute,
                        cuda_graphs=cfg.rollout.cuda_graphs and platform.has_cuda() and not meta)
    tconfig = provider.transformer_config()
    if meta:  # initialization on the meta device is free, and it marks which weights TP shards
        tconfig.use_cpu_initialization = True
    vpp = cfg.parallel.vpp
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        chunks.append(provider.build_stage(
            tconfig,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        ))
    if adapters and cfg.lora.rank:  # before DDP, which gives gradient buffers to trainable parameters only
        from megatron_rl.training.lora import add_adapters
        add_adapters(chunks, cfg.lora, tconfig, cfg.model, cfg.train.seed, init=not meta)
    if cfg.model.moe_router_frozen:  # before DDP, which gives gradient buffers to trainable parameters only
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if name.endswith("mlp.router.weight"):
                    param.requires_grad_(False)
    from megatron_rl.training import chunked
    if chunked.chunk_tokens(cfg) and not meta:
        chunked.install(chunks, chunked.chunk_tokens(cfg))
    if platform.has_cuda() and not meta:
        for chunk in chunks:
            chunk.to(platform.device())
    if dtype != torch.float32:
        chunks = [Float16Module(tconfig, chunk) for chunk in chunks]
    if wrap_ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=cfg.optimizer.sharded_buffers(),
            overlap_grad_reduce=False,
        )
        chunks = [
            DistributedDataParallel(tconfig, ddp_config, chunk,
                                    disable_bucketing=i > 0)  # only the first chunk buckets
            for i, chunk in enumerate(chunks)
        ]
    return chunks, tconfig


def build_optimizer(cfg: Config, model: list):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, s = cfg.optimizer, cfg.scheduler
    dtype = compute_dtype(cfg)
    config = OptimizerConfig(
        optimizer="adam" if o.name == "muon" else o.name, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, sgd_momentum=o.beta1,
        clip_grad=o.clip_grad, use_distributed_optimizer=o.sharded_buffers(),
        bf16=dtype == torch.bfloat16, params_dtype=dtype, **_optimizer_memory_kwargs(o))
    if o.name == "muon":
        from megatron_rl.training import muon

        optimizer = muon.build_optimizer(cfg, model, config)
    else:
        optimizer = get_megatron_optimizer(config, model)
    decay_steps = s.decay_steps or cfg.train.max_steps
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if s.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=s.warmup_steps, lr_decay_steps=max(decay_steps, s.warmup_steps + 1),
        lr_decay_style=s.decay, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant",
    )
    allocate_state(optimizer)
    return optimizer, scheduler


def allocate_state(optimizer) -> None:
    """torch Adam's state (a zero step count and zero moments, as its first step makes them) and Muon's
    (zero momentum buffers) made when
    the optimizer is built: a run that cannot hold it fails at start; it is laid out in memory before
    any activation (made at the end of the first step, it takes memory the first step's activations
    had used, and the second step's activations then come from fresh pages: on CPU tens of thousands
    of page faults); and megatron's distributed optimizer can load a checkpoint into it (its loading
    reads the state's 'step' first). torch.optim's Adam and AdamW, megatron's optimizer without
    Transformer Engine or apex, and Muon; other optimizers keep their lazy state."""
    from torch.optim.optimizer import _get_scalar_dtype

    from megatron_rl.training import muon

    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if isinstance(inner, torch.optim.Muon):
            muon.init_state(inner)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if state:
                    continue
                on_device = group["capturable"] or group["fused"]
                state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device) \
                    if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype())
                moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
                for name in moments:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _optimizer_memory_kwargs(o) -> dict:
    """optimizer.state_dtype and cpu_offload as megatron-core's OptimizerConfig fields. Its CPU
    offload runs on the precision-aware optimizer's code path, so both turn that on."""
    if not o.precision_aware_setting():
        return {}
    import torch

    moments = torch.bfloat16 if o.state_dtype == "bf16" else torch.float32
    return dict(use_precision_aware_optimizer=True, exp_avg_dtype=moments, exp_avg_sq_dtype=moments,
                optimizer_cpu_offload=o.cpu_offload > 0, optimizer_offload_fraction=o.cpu_offload,
                overlap_cpu_optimizer_d2h_h2d=o.cpu_offload > 0)


def build_trainee(cfg: Config) -> Trainee:
    from megatron_rl.training.step import finalize_grads

    model, tconfig = build_model(cfg, adapters=True)
    # The schedule calls this after the last backward: DP/embedding grad all-reduce and the
    # division by the global token count (calculate_per_token_loss).
    tconfig.finalize_model_grads_func = finalize_grads
    optimizer, scheduler = build_optimizer(cfg, model)
    return Trainee(model=model, optimizer=optimizer, scheduler=scheduler, config=tconfig,
                   max_skipped_steps=cfg.train.max_skipped_steps)


def write_run_assets(cfg: Config, run_dir, tokenizer):
    """<run_dir>/config.json, and <run_dir>/hf_assets: the tokenizer (and the HF config when starting
    from HF), kept with every checkpoint so that it exports to HF on its own. Written once the data,
    model and checkpoint have loaded, so that a run refused on bad input leaves its directory as it was."""
    import torch.distributed as dist

    from megatron_rl.hf import write_assets

    assets = run_dir / "hf_assets"
    if dist.get_rank() == 0:
        (run_dir / "config.json").write_text(cfg.to_json())
        write_assets(cfg.model.hf_path or None, assets, tokenizer)
    dist.barrier()
    return assets


def load_initial_state(trainee: Trainee, cfg: Config, run_dir):
    """Resume from the run's latest checkpoint (checkpoint.resume), else start from the weights of
    checkpoint.load or model.hf_path, else from the random init. Returns (checkpoint path or None,
    the resumed state {'step', 'extra'} or None). A LoRA run's checkpoints hold its adapters alone and
    name their base: resuming loads the base as the run started, checks it, then the adapters."""
    from megatron_rl import checkpointing

    latest = checkpointing.latest_checkpoint(run_dir, cfg.checkpoint.verify) if cfg.checkpoint.resume else None
    if latest is None and cfg.checkpoint.resume is True:
        raise ConfigError(f"checkpoint.resume=true but {run_dir} has no complete checkpoint to resume from; use "
                          "checkpoint.resume=auto to start fresh when there is none.")
    saved = checkpointing.saved_lora(latest) if latest is not None else None
    if cfg.lora.rank and (latest is None or saved):
        load_base(trainee.model, cfg, cfg.checkpoint.load, cfg.model.hf_path)
        source = cfg.checkpoint.load or cfg.model.hf_path
        trainee.base = {"path": str(Path(source).resolve()) if source else "",
                        "checksum": lora.base_checksum(trainee.model, cfg.model)}
        if latest is not None:
            lora.check_base(trainee.base["checksum"], saved["base"], latest)
    if latest is not None:
        return latest, checkpointing.load(trainee, latest)
    if not cfg.lora.rank:
        load_base(trainee.model, cfg, cfg.checkpoint.load, cfg.model.hf_path)
    if cfg.lora.adapter:
        from megatron_rl.hf.peft import import_peft
        import_peft(trainee.model, cfg.model, cfg.lora, cfg.lora.adapter)
    trainee.optimizer.reload_model_params()  # bf16 models keep fp32 main copies
    return None, None


def load_base(chunks: list, cfg: Config, checkpoint: str = "", hf: str = ""):
    """Weights from our checkpoint, else from an HF directory (nothing when neither is given). A LoRA
    checkpoint holds adapters only: its base first (recursively, checked against the checksum it
    recorded), then its adapters, merged into the base, and the adapters start afresh (a stacked stage)."""
    from megatron_rl import checkpointing
    from megatron_rl.hf import import_hf

    if not checkpoint:
        if hf:
            import_hf(chunks, cfg.model, hf)
        return
    path = checkpointing.resolve(checkpoint)
    checkpointing.check_model_matches(path, cfg.model)
    saved = checkpointing.saved_lora(path)
    if saved:
        base = saved["base"]["path"]
        ours = bool(base) and checkpointing.is_ours(base)
        load_base(chunks, cfg, base if ours else "", "" if ours else base)
        lora.check_base(lora.base_checksum(chunks, cfg.model), saved["base"], path)
    if checkpointing.load_weights(chunks, path, cfg.model.head, cfg.lora):
        lora.merge_and_reset(chunks, cfg.model, cfg.train.seed)

