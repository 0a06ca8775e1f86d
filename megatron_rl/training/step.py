"""Forward/backward through megatron-core's pipeline schedules, and reducing what they report.

A loss function gets the stage's output logits and the microbatch and returns
(loss_sum, num_tokens, report): megatron divides gradients by the global token count
(calculate_per_token_loss), so the result is the same whatever the microbatching and DP split.

With context parallelism each rank of a CP group gets its share of every sequence's tokens
(megatron's load-balanced split): per-token tensors of the microbatch are cut accordingly, and
batch["positions"] says which positions the rank holds. Per-token sums then add up over the CP
group like over DP; per-sequence quantities need `cp_sum` (and count once: `first_cp_rank`).
"""

import math
from functools import partial

import torch

from megatron_rl import platform
from megatron_rl.platform import device, watchdog
from megatron_rl.platform.job import RunStopped
from megatron_rl.training.chunked import ChunkedLogits


def cp_share(batch: dict) -> dict:
    """This context-parallel rank's share of a microbatch: the per-token (B, S, ...) tensors at the
    positions it holds, per-sample tensors whole, and "positions" (S / cp,). Without context
    parallelism: the batch itself, with positions 0..S-1."""
    from megatron.core import parallel_state as ps
    from megatron_rl.platform.attention import load_balanced_positions

    seq_len = batch["tokens"].shape[1]
    cp = ps.get_context_parallel_world_size()
    if "pack_cu" in batch:
        return _cp_share_packed(batch, cp, ps.get_context_parallel_rank() if cp > 1 else 0)
    if cp == 1:
        return {**batch, "positions": torch.arange(seq_len, device=batch["tokens"].device)}
    positions = load_balanced_positions(seq_len, cp, ps.get_context_parallel_rank(), batch["tokens"].device)
    share = {k: v[:, positions] if v.dim() >= 2 and v.shape[1] == seq_len else v for k, v in batch.items()}
    share["positions"] = positions
    return share


def _cp_share_packed(batch: dict, cp: int, rank: int) -> dict:
    """A packed microbatch (data/packing.py) on context-parallel rank `rank`: the model gets the rank's
    positions of the packed row (pack_mine: each sample's load-balanced chunks), and the output goes
    back to the whole (b, W) grid (pack_src -> pack_dst), the positions other ranks hold left 0 and
    out of the loss mask ("held"). Per-token sums then add up over the group as unpacked."""
    from megatron_rl.platform.attention import load_balanced_packed_positions

    device = batch["tokens"].device
    out = {**batch, "positions": torch.arange(batch["tokens"].shape[1], device=device)}
    if cp == 1:
        return {**out, "pack_src": batch["pack_pos"], "pack_dst": batch["pack_index"]}
    mine = load_balanced_packed_positions(batch["pack_cu"], cp, rank)
    grid_of = torch.full((int(batch["pack_cu"][-1]),), -1, dtype=torch.long, device=device)
    grid_of[batch["pack_pos"]] = batch["pack_index"]
    dst = grid_of[mine]
    keep = dst >= 0
    held = torch.zeros(batch["tokens"].numel(), device=device)
    held[dst[keep]] = 1.0
    held = held.view_as(batch["loss_mask"])
    return {**out, "pack_mine": mine, "pack_src": keep.nonzero().flatten(), "pack_dst": dst[keep], "held": held,
            "loss_mask": batch["loss_mask"] * held}


def put_tokens(out: torch.Tensor, mb: dict, values: torch.Tensor) -> None:
    """Write a microbatch's per-token values (b, W, ...) into the batch-wide (N, S, ...) `out` (on its
    device, in its dtype: on the compute device nothing is read back) at its rows (mb["index"]) and
    the positions this rank computed; 0 where another context-parallel rank holds the token (packed
    microbatches), so that cp_sum(out) adds up each token once."""
    if "held" in mb:
        held = mb["held"].bool().reshape(*mb["held"].shape, *[1] * (values.dim() - 2))
        values = values.masked_fill(~held, 0)
    rows, positions = mb["index"][:, None].to(out.device), mb["positions"][None, :].to(out.device)
    out[rows, positions] = values.to(out.device, out.dtype)


def cp_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over the context-parallel group (no gradient): per-sequence totals of token values."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return x
    x = x.detach().clone()
    torch.distributed.all_reduce(x, group=ps.get_context_parallel_group())
    return x


def cp_sum_straight_through(x: torch.Tensor) -> torch.Tensor:
    """x summed over the context-parallel group, with the gradient flowing into this rank's own x:
    every rank of the group sees each sequence's whole value (a loss that is not linear in it, such
    as DPO's sigmoid, needs that), and the backward reaches each rank's own tokens once."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return x
    return x + (cp_sum(x) - x.detach())


def first_cp_rank() -> bool:
    """Whether this rank counts per-sequence quantities for its context-parallel group."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank() == 0


def make_microbatches(cfg, batch: dict, per_microbatch: int, flatten=None) -> list[dict]:
    """This rank's batch as microbatches: `per_microbatch` units each, or with
    data.max_tokens_per_microbatch > 0 packed under that token budget (data/packing.py). Units lie
    along dim 0 (samples, or pairs that `flatten` turns into rows)."""
    import math

    from megatron.core import parallel_state as ps

    from megatron_rl.data import packing
    from megatron_rl.data.batches import microbatches

    budget, p = cfg.data.max_tokens_per_microbatch, cfg.parallel
    if not budget:
        micro = microbatches(batch, per_microbatch)
        return [flatten(m) for m in micro] if flatten else micro
    # Samples follow each other unpadded (attention pads them as its kernel needs), except with context
    # parallelism: each in 2 x cp load-balanced chunks.
    multiple = 2 * p.cp if p.cp > 1 else 1
    total_multiple = math.lcm((p.tp if p.sp else 1) * p.cp, multiple)  # a rank's share splits over TP (SP)
    chosen = packing.unit_groups(batch, budget, multiple)
    if cfg.model.num_experts and p.ep > 1:  # expert all-to-alls pair up microbatches across ranks
        n = torch.tensor([len(chosen)], device=device())
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX, group=ps.get_data_parallel_group())
        chosen = packing.split_to(chosen, int(n.item()))
    total = packing.round_up(budget, total_multiple) if p.pp > 1 else 0  # pipeline stages exchange fixed shapes
    return packing.packed_microbatches(batch, chosen, multiple, total_multiple, total, flatten)


def _packed_inputs(host: dict) -> tuple:
    """A packed microbatch's model inputs, worked out on the host from its (CPU) index tensors: the
    samples' tokens as one row (data/packing.py), their positions, and the attention's
    PackedSeqParams with the plan of its calls (megatron_rl/platform/attention.py packed_plan); so
    that the forward reads nothing from the device."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.data.packing import packed_row
    from megatron_rl.platform.attention import packed_plan, packed_positions

    cu = host["pack_cu"]
    packed = packed_row(host["tokens"], host)
    positions = packed_positions(cu, int(cu[-1]))[1][None]
    if "pack_mine" in host:  # this context-parallel rank's share of the row
        packed, positions = packed[:, host["pack_mine"]], positions[:, host["pack_mine"]]
    longest, on = int(cu.diff().max()), device()
    cu_device = cu.to(on)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_device, cu_seqlens_kv=cu_device,
                             cu_seqlens_q_padded=cu_device, cu_seqlens_kv_padded=cu_device, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    params.attention_plan = packed_plan(cu, on)
    return packed.to(on), positions.to(on), params


def _packed_forward(model, batch: dict, inputs: tuple):
    """The microbatch's packed row (_packed_inputs) through the model; on the last stage the output is
    put back into the samples' (b, W, ...) grid."""
    from megatron.core.utils import get_attr_wrapped_model

    packed, positions, params = inputs
    output = model(packed, positions, None, packed_seq_params=params)
    if not get_attr_wrapped_model(model, "post_process"):
        return output  # hidden states for the next pipeline stage
    b, w = batch["tokens"].shape

    def to_grid(row):
        grid = row.new_zeros(b * w, *row.shape[2:])
        grid[batch["pack_dst"]] = row[0, batch["pack_src"]]
        return grid.view(b, w, *row.shape[2:])

    return output.map_hidden(to_grid) if isinstance(output, ChunkedLogits) else to_grid(output)


def _forward_step(loss_fn, data_iterator, model):
    watchdog.beat("forward")
    host = cp_share(next(data_iterator))  # index work on the host, where it reads no device memory
    batch = {k: v.to(device()) for k, v in host.items()}
    if "pack_cu" in host:
        return _packed_forward(model, batch, _packed_inputs(host)), partial(loss_fn, batch)
    # attention_mask=None: the local spec's attention builds its causal mask itself.
    output = model(batch["tokens"], batch["positions"].unsqueeze(0).expand_as(batch["tokens"]), None)
    return output, partial(loss_fn, batch)


def forward_backward(trainee, micro: list[dict], loss_fn, forward_only: bool = False) -> list[dict]:
    """Run all microbatches through the schedule; returns the reports of the last stage (else [])."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    packed = "pack_cu" in micro[0]  # one row of all the samples' tokens (the same length on every stage)
    n_chunks = len(trainee.model)
    data = [iter(micro) for _ in range(n_chunks)] if n_chunks > 1 else iter(micro)
    with platform.weights_unchanged():  # no weight changes until the optimizer step
        return get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_fn),
            data_iterator=data,
            model=trainee.model,
            num_microbatches=len(micro),
            seq_length=int(micro[0]["pack_cu"][-1]) if packed else micro[0]["tokens"].shape[1],
            micro_batch_size=1 if packed else micro[0]["tokens"].shape[0],
            forward_only=forward_only,
        )


def forward_only(model_chunks: list, micro: list[dict], collect) -> None:
    """Run microbatches forward through the schedule without gradients; on the last pipeline stage
    collect(microbatch, output) sees each one's output (this context-parallel rank's positions)."""
    from types import SimpleNamespace

    def capture(mb, output):
        collect(mb, output)
        return torch.zeros((), device=device()), torch.tensor(1), {}

    with torch.no_grad():
        forward_backward(SimpleNamespace(model=model_chunks), micro, capture, forward_only=True)


def share_with_pipeline(x: torch.Tensor) -> torch.Tensor:
    """Values only the last pipeline stage computed (zeros elsewhere), on every stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        x = x.to(device())
        dist.all_reduce(x, group=ps.get_pipeline_model_parallel_group())
        x = x.cpu()
    return x


def reduce_reports(reports: list[dict]) -> dict[str, float]:
    """Sum report values over microbatches and data- and context-parallel ranks, then share them
    with every rank.

    Reports exist only on the last pipeline stage; it broadcasts the sums to the other stages.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    keys = sorted(reports[0]) if reports else []
    is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        holder = [keys]
        dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        keys = holder[0]
    sums = torch.zeros(len(keys), dtype=torch.float64, device=device())
    if is_last and reports and keys:  # each microbatch's values where its loss left them (the device): one read below
        sums = torch.stack([torch.stack([torch.as_tensor(r[k]).detach().to(device(), torch.float64) for k in keys])
                            for r in reports]).sum(0)
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(sums, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return dict(zip(keys, sums.tolist()))


def finalize_grads(model: list, num_tokens, pg_collection=None, force_all_reduce=False):
    """megatron-core's finalize_model_grads (the schedule calls it after the last backward: gradient
    all-reduces), with its division by the global token count done on the device: megatron's
    `if num_tokens > 0` waits for the GPU once a step. With no tokens the gradients are 0, and
    dividing by 1 leaves them so."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel.utils import get_pp_last_rank

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if num_tokens is None:
        return
    pp = pg_collection.pp if pg_collection is not None else ps.get_pipeline_model_parallel_group()
    dp_cp = pg_collection.dp_cp if pg_collection is not None else ps.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.broadcast(num_tokens, src=get_pp_last_rank(pp), group=pp)
    torch.distributed.all_reduce(num_tokens, group=dp_cp)
    scaling = 1.0 / num_tokens.clamp(min=1)
    for chunk in model:
        chunk.scale_gradients(scaling)


class Diverged(RunStopped):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def squared_grad_norms(optimizer) -> torch.Tensor:
    """The squares of the main gradients' L2 norms, on the device (nothing read): one per gradient-
    statistics group (one, unless expert parallelism gives the experts' optimizer its own). Each is
    the norm of the per-tensor norms (one torch._foreach_norm), squared and summed over its group:
    megatron's choice of the grads and the groups (model parallel, or the whole world with the
    distributed optimizer) and its arithmetic without apex, so that global_norm gives its number to the bit."""
    subs = _sub_optimizers(optimizer)
    # megatron's layer-wise optimizer (Muon's distributed one) holds each matrix on one data-parallel
    # rank: its norm sums over the whole world, as its get_grad_norm does
    layer_wise = _layer_wise(optimizer)
    shared = len(subs) == 1 or layer_wise or optimizer.grads_states_parallel_group_is_shared()
    squares = []
    for group in [subs] if shared else [[sub] for sub in subs]:
        grads = [g for sub in group for g in sub.get_main_grads_for_grad_norm()]
        squared = torch.norm(torch.stack(torch._foreach_norm(grads))) ** 2 if grads else torch.zeros((), device=device())
        torch.distributed.all_reduce(squared, group=None if layer_wise else group[0].get_grad_stats_parallel_group())
        squares.append(squared)
    return torch.stack(squares)


def _layer_wise(optimizer) -> bool:
    return hasattr(optimizer, "allgather_params")


def global_norm(squares: list[float]) -> float:
    """The global gradient norm from squared_grad_norms, read: megatron's arithmetic (its chained
    optimizer adds the groups' norms' squares on the host)."""
    if len(squares) == 1:
        return squares[0] ** 0.5
    return math.sqrt(sum((s ** 0.5) ** 2 for s in squares))


def _clip(optimizer, norm: float) -> None:
    """Scale each sub-optimizer's gradients by clip_grad / norm where the norm exceeds its clip_grad
    (megatron's clip_grad_by_total_norm_fp32, one fused multiply)."""
    for sub in _sub_optimizers(optimizer):
        clip = sub.config.clip_grad
        coefficient = clip / (norm + 1.0e-6)
        if clip <= 0.0 or coefficient >= 1.0 or getattr(sub, "is_stub_optimizer", False):
            continue
        decoupled = sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        grads = [g for p in sub.get_parameters() if (g := getattr(p, "decoupled_grad" if decoupled else "grad", None))
                 is not None]
        if grads:
            torch._foreach_mul_(grads, coefficient)


def optimizer_step(trainee) -> tuple[bool, float]:
    """One optimizer + LR-schedule step after gradients were accumulated; (applied, grad_norm).

    The gradient norm is computed once (squared_grad_norms) and read once: that read is the step's
    finite check. A NaN or Inf anywhere in the gradients (a non-finite loss makes them so) gives a non-finite
    global norm, the same all-reduced number on every rank: then no rank updates (megatron's bf16/fp32
    optimizers would step anyway) and the LR schedule stays; the step's data is consumed. After
    trainee.max_skipped_steps such steps in a row, Diverged."""
    watchdog.beat("optimizer step")
    optimizer = trainee.optimizer
    if optimizer.prepare_grads():  # fp16 loss scaling's own overflow check: megatron skips the step
        return False, 0.0
    norm = global_norm(squared_grad_norms(optimizer).tolist())
    if not math.isfinite(norm):
        trainee.skipped_steps += 1
        trainee.skipped_in_a_row += 1
        if trainee.skipped_in_a_row >= trainee.max_skipped_steps:
            raise Diverged(f"{trainee.skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                           f"norm (train.max_skipped_steps={trainee.max_skipped_steps}), so the run stops; its "
                           "last checkpoint is intact: resume with a lower optimizer.lr or check the data.")
        return False, norm
    _clip(optimizer, norm)
    optimizer.step_with_ready_grads()
    if _layer_wise(optimizer):
        optimizer.allgather_params()  # each rank updated its own matrices: share them
    trainee.skipped_in_a_row = 0
    trainee.scheduler.step(increment=1)
    return True, norm


def zero_grads(trainee):
    for chunk in trainee.model:
        chunk.zero_grad_buffer()
    trainee.optimizer.zero_grad()


def train_step(trainee, micro: list[dict], loss_fn) -> tuple[dict, float]:
    """One optimizer step on the gradients of `micro`: (summed report, grad norm)."""
    zero_grads(trainee)
    report = reduce_reports(forward_backward(trainee, micro, loss_fn))
    _, grad_norm = optimizer_step(trainee)
    return report, grad_norm


def validation_report(trainee, micro: list[dict], loss_fn) -> dict:
    """The summed report of a forward-only pass over `micro` in eval mode (validation)."""
    trainee.eval()
    try:
        with torch.no_grad():
            return reduce_reports(forward_backward(trainee, micro, loss_fn, forward_only=True))
    finally:
        trainee.train()


def schedule_metrics(trainee) -> dict:
    """The learning rate now, and how many optimizer steps were skipped (non-finite) so far."""
    return {"train/lr": trainee.scheduler.get_lr(trainee.optimizer.param_groups[0]),
            "train/skipped_steps": trainee.skipped_steps}


def dp_share(data: dict) -> dict:
    """This data-parallel rank's share of a dict of equally long sequences (every size-th row)."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return {k: v[rank::size] for k, v in data.items()}
