"""Per-rank memory and FLOPs of a recipe's layout, without its hardware.

One CPU process joins a fake process group of the recipe's world size once per pipeline stage, as
the first rank of that stage (tensor, context and data rank 0), and builds that rank's model
chunks on the meta device: the exact parameters megatron-core would place there, in well under a
second for a 100B+ MoE. From them, per rank: bytes of weights, gradients and optimizer state, plus
estimates of activations and the rollout KV cache, against the GPU's memory.
"""

import dataclasses
import json
from dataclasses import dataclass, field

import torch

from megatron_rl import platform  # noqa: F401  (CPU stand-ins for megatron-core, before it is imported)
from megatron_rl.config import Config
from megatron_rl.training.chunked import chunk_tokens
from megatron_rl.training.muon import is_matrix

GPUS = {"a100": 80, "h100": 80, "h200": 141, "b200": 180, "gb200": 186}
"""GPU memory in GB (1e9 bytes) per device."""
GPU_BF16_TFLOPS = {"a100": 312, "h100": 989, "h200": 989, "b200": 2250, "gb200": 2500}
"""Dense bf16 peak per device, for the time a step's FLOPs take at a given utilization."""
RUNTIME_RESERVE = 5e9
"""CUDA context, NCCL buffers and allocator fragmentation: a rule-of-thumb allowance per GPU."""


@dataclass
class StagePlan:
    """The first rank of one pipeline stage. Byte counts are exact for weights, gradients and
    optimizer state (megatron's buffers without their alignment padding); activations and KV cache
    are estimates."""

    stage: int
    rank: int
    layers: int
    params: int  # on this rank
    expert_params: int  # of which in MoE experts (sharded over expert parallelism)
    weights: int  # bytes
    grads: int
    optimizer: int
    activations: int
    kv_cache: int
    reserve: int = RUNTIME_RESERVE
    host: int = 0  # bytes of optimizer state this rank keeps in host memory (optimizer.cpu_offload)
    others: int = 0  # bytes of the other models on this rank (reference, critic with its gradients and optimizer, ...)
    role: str = "train"  # or "generate": a generation rank of a disaggregated job (parallel.rollout_ranks)
    matrices: int = 0  # of the parameters it keeps optimizer state for, those Muon trains (optimizer.name=muon)
    state_params: int = 0  # the parameters it keeps optimizer state for

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.activations + self.kv_cache + self.reserve
                + self.others)


@dataclass
class Plan:
    recipe: str
    world_size: int
    gpu: str
    stages: list[StagePlan] = field(default_factory=list)
    total_params: int = 0  # of the whole model
    active_params: int = 0  # per token (MoE: the routed top-k of the experts)
    adapter_params: int = 0  # LoRA's adapters (the only trainable parameters), not in total_params
    train_flops: float = 0.0  # per optimizer step, all ranks
    rollout_flops: float = 0.0  # per step's rollouts and logprob passes, all ranks
    others: list[str] = field(default_factory=list)  # the other models counted in each stage's `others`
    parallel: object = None  # the ParallelConfig planned

    @property
    def gpu_bytes(self) -> float:
        return GPUS[self.gpu] * 1e9

    @property
    def fits(self) -> bool:
        return all(s.total <= self.gpu_bytes for s in self.stages)


def _dtype_bytes(cfg: Config) -> int:
    return 4 if cfg.train.precision == "fp32" else 2  # 'auto' is bf16 on a GPU


def optimizer_bytes_per_param(cfg: Config, matrix: bool = False) -> tuple[float, float]:
    """Optimizer state per parameter of a rank's shard: (in GPU memory, in host memory).

    Muon (optimizer.name=muon) keeps one fp32 momentum per parameter of the matrices it trains (`matrix`),
    plus the main copy with low-precision weights: 4 or 8 bytes; the other parameters are Adam's.

    Adam keeps exp_avg and exp_avg_sq, and with low-precision weights an fp32 main copy: 12 bytes.
    optimizer.state_dtype=bf16 (the precision-aware optimizer) keeps the moments in bf16 and the
    main copy as the 16 bits the bf16 weight lacks (TE's store_param_remainders): 6 bytes.
    optimizer.cpu_offload=f moves a share f of the parameters' state to the host, where megatron's
    hybrid optimizer also keeps an fp32 copy of their gradients: 16 bytes each there."""
    o = cfg.optimizer
    low_precision = _dtype_bytes(cfg) < 4
    if o.name == "muon" and matrix:
        return 4.0 + (4.0 if low_precision else 0.0), 0.0
    if o.name not in ("adam", "muon"):
        return (4.0 if low_precision else 0.0), 0.0
    if o.state_dtype == "bf16":
        return 6.0, 0.0
    full = 8 + (4 if low_precision else 0)
    return full * (1 - o.cpu_offload), (full + 4) * o.cpu_offload


def stage_ranks(cfg: Config, world_size: int) -> list[int]:
    """The global rank of each pipeline stage's first rank (megatron's tp-cp-ep-dp-pp order: the
    pipeline rank varies slowest)."""
    per_stage = world_size // cfg.parallel.pp
    return [stage * per_stage for stage in range(cfg.parallel.pp)]


def _build_on_meta(cfg: Config, rank: int, world_size: int):
    """This rank's model chunks on the meta device, under a fake process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_rl.training.setup import build_model

    _shutdown()  # the previous stage's fake group
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    p = cfg.parallel
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp or None,
        create_gloo_process_groups=False)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)  # Mamba layers draw their initial values under the tracker's fork
    with torch.device("meta"):
        chunks, _ = build_model(cfg, wrap_ddp=False, meta=True, adapters=True)
    return chunks


def _is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)  # megatron marks expert parameters allreduce=False


def _layer_kinds(chunks) -> str:
    """This rank's layers, one symbol each as in model.hybrid_pattern ('*' for every layer of a
    model that is not a hybrid)."""
    decoders = [getattr(c, "module", c).decoder for c in chunks]  # under Float16Module for bf16
    return "".join("".join(d.layer_type_list) if hasattr(d, "layer_type_list") else "*" * len(d.layers)
                   for d in decoders)


def activation_bytes(cfg: Config, layers: int, stage: int) -> int:
    """Activations kept for the backward on one rank, for its in-flight microbatches (1F1B keeps
    pp - stage of them). Per token and layer in the model dtype: about 6h for
    attention's inputs and outputs (flash attention keeps no scores) and 4f for the MLP (f: the
    FFN width a token goes through, top-k experts for MoE); sharded over TP with sequence
    parallelism, and over CP. With train.recompute=full only each layer's input (h) is kept, plus
    the one layer being recomputed. The last stage adds the fp32 logits (of data.logprob_chunk_tokens
    tokens with chunking on)."""
    m, p = cfg.model, cfg.parallel
    tokens = cfg.data.micro_batch_size * cfg.data.seq_length
    ffn = m.moe_topk * m.moe_ffn_hidden_size + m.moe_shared_ffn_hidden_size if m.num_experts else m.ffn_hidden_size
    per_layer = tokens * (6 * m.hidden_size + 4 * ffn) * _dtype_bytes(cfg)
    split = p.cp * (p.tp if p.sp else 1)
    recomputed = 0
    if cfg.train.recompute == "full":
        per_layer, recomputed = tokens * m.hidden_size * _dtype_bytes(cfg), per_layer // split
    in_flight = p.pp - stage  # 1F1B's warm-up depth: an upper bound
    rows = tokens // p.cp  # this rank's tokens of the microbatch; data.logprob_chunk_tokens at a time
    rows = min(rows, chunk_tokens(cfg)) if chunk_tokens(cfg) else rows
    logits = rows * m.vocab_size * 4 // p.tp if stage == p.pp - 1 else 0
    return (layers * per_layer // split) * in_flight + recomputed + logits


def kv_cache_bytes(cfg: Config, kinds: str) -> int:
    """The rollout engine's KV cache on one rank, whose layers are `kinds`: all max_requests at
    max_sequence_length, or the configured reservation (rollout.kv_cache_gb) if larger. The per-token
    size is what our engine asks megatron's dynamic context for (MLA caches one latent per token);
    a hybrid caches keys and values in its attention layers only, and each request's
    convolution and SSM states in its Mamba layers."""
    r = cfg.rollout
    needed = (kv_bytes_per_token(cfg, kinds.count("*")) * r.max_sequence_length
              + mamba_state_bytes(cfg) * kinds.count("M")) * r.max_requests
    return max(needed, int(r.kv_cache_gb * 1024**3))


def mamba_state_bytes(cfg: Config) -> int:
    """One request's state in one Mamba layer on one rank: the convolution's last inputs (x, B, C
    channels x kernel width) in the model dtype and the SSM state (heads x head dim x state size) in
    fp32 (the rollout engine's context keeps them so)."""
    m, tp = cfg.model, cfg.parallel.tp
    conv = (m.mamba_num_heads * m.mamba_head_dim + 2 * m.mamba_num_groups * m.mamba_state_dim) // tp
    ssm = m.mamba_num_heads // tp * m.mamba_head_dim * m.mamba_state_dim
    return conv * m.mamba_conv_kernel * _dtype_bytes(cfg) + ssm * 4


def kv_bytes_per_token(cfg: Config, layers: int) -> int:
    """Keys and values of one token in the rollout engine's cache on one rank."""
    from megatron_rl.rollout.engine import kv_cache_layout

    heads, channels = kv_cache_layout(cfg.model)
    if cfg.model.multi_latent_attention:  # one latent per token, whole on every tensor-parallel rank
        return layers * channels * _dtype_bytes(cfg)
    return 2 * layers * max(1, heads // cfg.parallel.tp) * channels * _dtype_bytes(cfg)


def plan(cfg: Config, world_size: int = 0, gpu: str = "h100") -> Plan:
    """The per-stage plan of `cfg` on `world_size` GPUs (0: tp x pp x cp x dp of the recipe)."""
    p = cfg.parallel
    world_size = world_size or cfg.parallel.recipe_world_size()
    cfg.validate(world_size)
    trainers = p.trainers(world_size)  # all ranks, unless generation ranks (parallel.rollout_ranks) are apart
    dp = p.data_parallel_size(trainers)
    expert_dp = trainers // (p.pp * p.ep * (p.etp or p.tp))
    wbytes = _dtype_bytes(cfg)
    state, host_state = optimizer_bytes_per_param(cfg)
    result = Plan(cfg.recipe, world_size, gpu, parallel=p)
    stages, dense_total, expert_total, result.adapter_params = _parameter_counts(cfg, trainers)
    for stage, (rank, n, experts, kinds, trainable, trainable_experts, matrices) in enumerate(stages):
        layers = len(kinds)
        sharded = _optimizer_params(cfg, trainable, trainable_experts, dp, expert_dp)  # LoRA: the adapters only
        in_matrices = sharded * matrices // max(trainable, 1) if cfg.optimizer.name == "muon" else 0
        result.stages.append(StagePlan(
            stage=stage, rank=rank, layers=layers, params=n, expert_params=experts, weights=n * wbytes,
            grads=trainable * 4,  # gradients are reduced and kept in fp32 (grad_reduce_in_fp32)
            optimizer=int(state * (sharded - in_matrices) + optimizer_bytes_per_param(cfg, True)[0] * in_matrices),
            activations=activation_bytes(cfg, layers, stage), kv_cache=0 if p.rollout_ranks else kv_cache_bytes(cfg, kinds),
            host=int(host_state * sharded), matrices=in_matrices, state_params=sharded))
    _add_other_models(cfg, trainers, result, dp, expert_dp)
    if p.rollout_ranks:
        result.stages.append(_generation_rank(cfg, trainers))
    m = cfg.model
    result.total_params = dense_total + expert_total
    routed = m.moe_topk / m.num_experts if m.num_experts else 1.0
    result.active_params = int(dense_total + expert_total * routed)
    result.train_flops, result.rollout_flops = step_flops(cfg, result.active_params)
    return result


def _generation_rank(cfg: Config, trainers: int) -> StagePlan:
    """The first generation rank of a disaggregated job: the policy's weights in the generation layout
    (parallel.rollout_tp, rollout_ep, one stage, no adapters: they arrive merged) and the rollout's KV cache
    of every layer; no gradients, optimizer state or training activations."""
    from megatron_rl.config import LoRAConfig

    g = dataclasses.replace(cfg, parallel=cfg.parallel.generation_layout(cfg.model), lora=LoRAConfig())
    (rank, n, experts, kinds, *_), = _parameter_counts(g, cfg.parallel.rollout_ranks)[0]
    return StagePlan(stage=0, rank=trainers + rank, layers=len(kinds), params=n, expert_params=experts,
                     weights=n * _dtype_bytes(cfg), grads=0, optimizer=0, activations=0,
                     kv_cache=kv_cache_bytes(cfg, kinds), role="generate")


def _optimizer_params(cfg: Config, n: int, experts: int, dp: int, expert_dp: int) -> int:
    """How many of a rank's n parameters (experts of them in MoE experts) it keeps optimizer state for: all,
    or with the distributed optimizer its share over the data-parallel (expert data-parallel) ranks."""
    if not cfg.optimizer.distributed:
        return n
    return (n - experts) // dp + experts // expert_dp


def other_models(cfg: Config) -> list[tuple[str, Config, bool]]:
    """The models a run builds beside the policy, each (name, a config building it, trained): PPO's critic
    (the policy with a score head and its own optimizer), the reference (a frozen copy of the policy, with
    a KL penalty or in DPO), and the reward model or teacher(s) where their checkpoint or HF directory is
    readable here (their own architecture, frozen)."""
    from megatron_rl.config.tree import ON_POLICY

    from megatron_rl.config import LoRAConfig

    a, out = cfg.algorithm, []
    if a.name == "ppo":  # trained in full, without adapters
        critic = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, head="score"), lora=LoRAConfig())
        out.append(("critic", critic, True))
    needs_reference = (a.name in ON_POLICY and a.kl_coef) or (a.name == "dpo" and not a.precompute_reference)
    if needs_reference and not cfg.lora.rank:  # LoRA's reference is the policy with its adapters off: free
        out.append(("reference", cfg, False))
    paths = {"reward model": cfg.rewards.model if cfg.rewards.fn == "reward_model" else ""}
    if a.name == "distill":
        paths.update({f"teacher {k}": v for k, v in cfg.distill.teachers.items()} or {"teacher": cfg.distill.teacher})
    for name, path in paths.items():
        model = _readable_model(path)
        if model is not None:
            out.append((name, dataclasses.replace(cfg, model=model, lora=LoRAConfig()), False))
    return out


def _readable_model(path: str):
    """The ModelConfig of our checkpoint or an HF directory at `path`, or None where it cannot be read."""
    from pathlib import Path

    from megatron_rl import checkpointing
    from megatron_rl.hf import model_config_from_hf

    if not path or not Path(path).is_dir():
        return None
    try:
        if checkpointing.is_ours(path):
            return checkpointing.read_model_config(checkpointing.resolve(path))
        return model_config_from_hf(path)
    except Exception:  # noqa: BLE001  (a planner estimate goes on without a model it cannot read)
        return None


def _add_other_models(cfg: Config, world_size: int, result: Plan, dp: int, expert_dp: int):
    """Each stage's bytes of the other models on its rank: weights, and for a trained one (the critic)
    gradients and optimizer state as the policy's."""
    state, _ = optimizer_bytes_per_param(cfg)
    for name, other, trained in other_models(cfg):
        result.others.append(name)
        stages, *_ = _parameter_counts(other, world_size)
        for plan_stage, (_, n, experts, *_) in zip(result.stages, stages):
            plan_stage.others += n * _dtype_bytes(other)
            if trained:
                plan_stage.others += n * 4 + int(state * _optimizer_params(cfg, n, experts, dp, expert_dp))


_COUNTS: dict[str, tuple] = {}


def _parameter_counts(cfg: Config, world_size: int) -> tuple[list[tuple], int, int, int]:
    """Per pipeline stage (its first rank, its parameters, of which in experts, its layers' kinds, its
    trainable parameters and of which in experts: fewer than all with LoRA, and of which in the matrices
    Muon trains), and the whole model's dense,
    expert and LoRA adapter parameters. They depend on the architecture and the layout only,
    so `fit` builds each layout once however many memory settings it tries."""
    p = cfg.parallel
    key = json.dumps([dataclasses.asdict(cfg.model), dataclasses.asdict(p), dataclasses.asdict(cfg.fp8),
                      dataclasses.asdict(cfg.lora), world_size])
    if key not in _COUNTS:
        stages, dense_total, expert_total, adapters = [], 0, 0, 0
        etp = p.etp or p.tp
        for rank in stage_ranks(cfg, world_size):
            chunks = _build_on_meta(cfg, rank, world_size)
            params = [q for c in chunks for q in c.parameters()]
            trained = [q for q in params if q.requires_grad]
            stages.append((rank, sum(q.numel() for q in params), sum(q.numel() for q in params if _is_expert(q)),
                           _layer_kinds(chunks), sum(q.numel() for q in trained),
                           sum(q.numel() for q in trained if _is_expert(q)),
                           sum(q.numel() for q in trained if is_matrix(q))))
            # The whole model: TP-sharded parameters exist tp times, experts ep x etp times; LoRA's adapters
            # (the trainable parameters of a model with frozen ones) apart.
            lora = cfg.lora.rank > 0
            for q in params:
                if lora and q.requires_grad:
                    adapters += q.numel() * (p.tp if getattr(q, "tensor_model_parallel", False) else 1)
                elif _is_expert(q):
                    expert_total += q.numel() * p.ep * (etp if getattr(q, "tensor_model_parallel", False) else 1)
                else:
                    dense_total += q.numel() * (p.tp if getattr(q, "tensor_model_parallel", False) else 1)
        _shutdown()
        _COUNTS[key] = stages, dense_total, expert_total, adapters
    return _COUNTS[key]


def step_flops(cfg: Config, active_params: int) -> tuple[float, float]:
    """Model FLOPs of one step over all ranks: training (6 x active parameters per token, forward
    and backward, over the step's samples at seq_length tokens, times epochs), and rollouts (2 x per
    generated or re-scored token: generation, the old-policy pass, and the reference pass with KL).
    Attention's quadratic term is left out (short RL sequences)."""
    from megatron_rl.config.tree import ON_POLICY

    a, r = cfg.algorithm, cfg.rollout
    if a.name in ON_POLICY:
        samples = a.prompts_per_step * r.n
        critic = a.name == "ppo"  # trained like the policy, and one more forward for the old values
        train = 6 * active_params * samples * cfg.data.seq_length * a.epochs * (1 + critic)
        passes = 1 + (a.kl_coef > 0) + critic + (a.name == "distill")  # (a teacher counted at the policy's size)
        rollout = 2 * active_params * samples * (r.max_new_tokens + passes * cfg.data.seq_length)
        return float(train), float(rollout)
    return float(6 * active_params * cfg.data.global_batch_size * cfg.data.seq_length), 0.0


def _shutdown():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


MEMORY_SETTINGS = [
    [],
    ["optimizer.distributed=true"],
    ["optimizer.distributed=true", "optimizer.state_dtype=bf16"],
    ["optimizer.distributed=true", "train.recompute=full"],
    ["optimizer.distributed=true", "optimizer.state_dtype=bf16", "train.recompute=full"],
    ["optimizer.distributed=true", "train.recompute=full", "optimizer.state_dtype=fp32", "optimizer.cpu_offload=0.5"],
    ["optimizer.distributed=true", "train.recompute=full", "optimizer.state_dtype=fp32", "optimizer.cpu_offload=1"],
]
"""What `fit` tries on a layout, cheapest in step time first: sharding the optimizer state over
data-parallel ranks costs nothing; bf16 moments cost no time; full recompute costs about a third
more training compute; moving optimizer state to the host (in fp32: megatron's offload keeps no bf16
state) costs its copies and a CPU update."""


@dataclass
class Fit:
    """Settings under which a recipe fits: overrides (and the world size they need), with their plan."""

    overrides: list[str]
    world_size: int
    plan: Plan


def fit(cfg: Config, world_size: int = 0, gpu: str = "h100", max_factor: int = 8) -> Fit | None:
    """The first settings under which `cfg` fits on `gpu`: the memory settings on its own layout,
    then on layouts with 2, 4, ... up to max_factor times the GPUs (tensor parallelism widened up to 8,
    else more pipeline stages). None if nothing tried fits."""
    import copy

    from megatron_rl.config import ConfigError, apply_overrides

    p, m = cfg.parallel, cfg.model
    world_size = world_size or cfg.parallel.recipe_world_size()
    layouts = [([], world_size)]
    factor = 2
    while factor <= max_factor:
        if p.tp * factor <= 8:
            layouts.append(([f"parallel.tp={p.tp * factor}"], world_size * factor))
        if m.num_layers % (p.pp * factor) == 0:
            layouts.append(([f"parallel.pp={p.pp * factor}", "parallel.first_stage_layers=0",
                             "parallel.last_stage_layers=0"], world_size * factor))
        factor *= 2
    tried = set()
    for layout, size in layouts:
        for settings in MEMORY_SETTINGS:
            trial = apply_overrides(copy.deepcopy(cfg), layout + settings)
            key = (size, trial.to_json())
            if key in tried:
                continue
            tried.add(key)
            try:
                result = plan(trial, size, gpu)
            except ConfigError:
                continue  # not a valid layout or setting for this model
            if result.fits:
                changed = [o for o in layout + settings
                           if apply_overrides(copy.deepcopy(cfg), [o]).to_json() != cfg.to_json()]
                return Fit(changed, size, result)
    return None


def format_fit(found: Fit | None, world_size: int) -> str:
    """One line saying what to change so that a recipe that does not fit does."""
    if found is None:
        return "Nothing the planner tries fits (memory settings, up to 8 x the GPUs): raise tp/pp/ep by hand."
    worst = max(s.total for s in found.plan.stages) / 1e9
    gpus = GPUS[found.plan.gpu]
    if found.world_size == world_size:
        return f"It fits with {' '.join(found.overrides)}: the fullest rank needs {worst:.1f} of {gpus} GB."
    return (f"It does not fit on {world_size} GPUs with any memory setting; the smallest layout found that fits: "
            f"--world-size {found.world_size} {' '.join(found.overrides)} (the fullest rank needs {worst:.1f} of "
            f"{gpus} GB).")


def format_plan(result: Plan) -> str:
    gb = lambda b: f"{b / 1e9:8.1f}"  # noqa: E731
    lines = [f"recipe {result.recipe}: {result.world_size} GPUs ({result.gpu}, {GPUS[result.gpu]} GB each); model "
             f"{result.total_params / 1e9:.1f}B parameters, {result.active_params / 1e9:.1f}B active per token"
             + (f"; LoRA adapters {result.adapter_params / 1e9:.2f}B (the only trainable parameters)"
                if result.adapter_params else ""),
             "", "stage  rank layers  params(B)  weights  grads  optimizer  activations  kv-cache  reserve   others    total (GB)"]
    for s in result.stages:
        stage = f"{s.stage:5d}" if s.role == "train" else "  gen"
        lines.append(f"{stage} {s.rank:5d} {s.layers:6d} {s.params / 1e9:10.2f} {gb(s.weights)} {gb(s.grads)}"
                     f" {gb(s.optimizer)}   {gb(s.activations)}  {gb(s.kv_cache)} {gb(s.reserve)} {gb(s.others)} {gb(s.total)}")
    worst = max(result.stages, key=lambda s: s.total)
    peak = GPU_BF16_TFLOPS[result.gpu] * 1e12 * result.world_size
    total = result.train_flops + result.rollout_flops
    lines += ["", f"model FLOPs per step: training {result.train_flops:.3g}, rollout and logprob passes "
                  f"{result.rollout_flops:.3g}; at 40% of the bf16 peak: {total / (0.4 * peak):.1f} s per step",
              ("FITS" if result.fits else "DOES NOT FIT") + ": the fullest rank ("
              + (f"stage {worst.stage}" if worst.role == "train" else "a generation rank") + ") needs "
              f"{worst.total / 1e9:.1f} of {GPUS[result.gpu]} GB" + ("." if result.fits else ":")]
    generation = [s for s in result.stages if s.role == "generate"]
    if generation:
        p = result.parallel
        lines.insert(-1, f"gen: the first of {p.rollout_ranks} generation ranks (parallel.rollout_ranks; TP{p.rollout_tp}"
                         f" x EP{p.rollout_ep}, one stage): the policy's weights and the rollout's KV cache only; the "
                         f"other {result.world_size - p.rollout_ranks} ranks train and hold no KV cache")
    if result.others:
        lines.insert(-1, f"others: {', '.join(result.others)} (weights; a trained model also its gradients and "
                         "optimizer state)")
    muon = max(result.stages, key=lambda s: s.matrices)
    if muon.matrices:
        lines.insert(-1, f"optimizer.name=muon: stage {muon.stage}'s rank keeps state for {muon.state_params / 1e9:.2f}B "
                         f"parameters: one momentum each for the {muon.matrices / 1e9:.2f}B in matrices (Muon), "
                         f"Adam's two moments for the other {(muon.state_params - muon.matrices) / 1e9:.2f}B")
    host = max(s.host for s in result.stages)
    if host:
        lines.insert(-1, f"optimizer state in host memory (optimizer.cpu_offload): up to {host / 1e9:.1f} GB per GPU")
    return "\n".join(lines)
