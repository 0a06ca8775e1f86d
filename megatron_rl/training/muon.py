"""Muon (optimizer.name=muon): orthogonalized momentum for the hidden layers' matrices, Adam for the rest.

torch.optim.Muon updates whole matrices on one process. Under tensor parallelism each rank holds a shard
of a matrix, and orthogonalizing the shards one by one is another update; here a matrix's momentum is
gathered from its tensor-parallel group, the whole is orthogonalized (on every rank of the group: megatron-
core's "duplicated" mode) and each rank keeps its rows or columns. The parameters are grouped as megatron-
core's Muon wrapper groups them (optimizer/muon.py, which needs the emerging-optimizers package and so
Python 3.12): 2-D weights other than the embedding and output layers to Muon, dense and expert apart, the
rest to megatron's Adam, chained; with optimizer.distributed its LayerWiseDistributedOptimizer gives each
data-parallel rank whole matrices to update and all-gathers the new weights after the step.
"""

from contextlib import contextmanager

import torch


def is_matrix(param) -> bool:
    """Whether Muon trains `param`: a 2-D weight that is not the embedding or an output layer (the
    vocabulary's or a score head's): attention, MLP, experts, routers, Mamba's projections, LoRA adapters."""
    return param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def newton_schulz(x: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalized `x` (2-D): torch.optim.Muon's quintic Newton-Schulz iteration, in bf16 its own
    function, in fp32 the same iteration with fp32 matmuls (megatron-core's choice)."""
    if dtype == torch.bfloat16:
        from torch.optim._muon import _zeropower_via_newtonschulz

        return _zeropower_via_newtonschulz(x, tuple(coefficients), steps, eps)
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    y = x.float().T if tall else x.float()
    y = y / y.norm().clamp(min=eps)
    for _ in range(steps):
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.T if tall else y


def _whole(shard: torch.Tensor, param, expert: bool) -> tuple[torch.Tensor, object, int]:
    """(the whole matrix of a tensor-parallel shard, its group or None, the partition dim)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return shard, None, 0
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return shard, None, 0
    parts = [torch.empty_like(shard) for _ in range(size)]
    torch.distributed.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim), group, param.partition_dim


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose update orthogonalizes each tensor-parallel matrix whole (megatron's param
    groups say which are experts': their tensor-parallel group is the expert one), in `ns_dtype`."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.float32, **options):
        super().__init__(params, **options)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim._muon import _adjust_lr

        assert closure is None, "Muon here takes no closure"
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            momentum, lr = group["momentum"], group["lr"]
            for param, grad, buffer in zip(params, grads, buffers):
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                whole, tp_group, dim = _whole(update, param, group.get("is_expert_parallel", False))
                update = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                if tp_group is not None:
                    update = update.chunk(torch.distributed.get_world_size(tp_group), dim=dim)[
                        torch.distributed.get_rank(tp_group)]
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], whole.shape))


def init_state(optimizer, config=None) -> None:
    """Muon's momentum buffers, made before a checkpoint loads into them (and at build: see
    setup.allocate_state for why)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)


@contextmanager
def _only_trainable(trainable: list, subset: list):
    """Within: of the `trainable` parameters only `subset` requires gradients (megatron builds an
    optimizer's param groups from the parameters that do)."""
    keep = {id(p) for p in subset}
    for p in trainable:
        p.requires_grad_(id(p) in keep)
    try:
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


def build_optimizer(cfg, model: list, config):
    """Muon for the matrices chained with megatron's Adam for the rest; `config` is megatron's
    OptimizerConfig for the Adam part (optimizer='adam', not its distributed optimizer)."""
    from megatron.core.optimizer import _get_param_groups, get_megatron_optimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    o = cfg.optimizer
    layer_wise = o.distributed
    trainable = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
    matrices = [p for p in trainable if is_matrix(p)]
    with _only_trainable(trainable, matrices):
        groups = _get_param_groups(model, config, None)
    # Without the layer-wise optimizer the experts' matrices get their own optimizer: their gradient
    # statistics sum over another group (tensor, expert and pipeline parallel ranks), as megatron's wrapper does.
    parts = [groups] if layer_wise else [[g for g in groups if not g["is_expert_parallel"]],
                                         [g for g in groups if g["is_expert_parallel"]]]
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    optimizers = []
    for part in filter(None, parts):
        muon = Muon(part, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                    ns_coefficients=tuple(o.muon_ns_coefficients), ns_steps=o.muon_ns_steps,
                    adjust_lr_fn=o.muon_lr_scale,
                    ns_dtype=torch.float32 if o.muon_ns_dtype == "fp32" else torch.bfloat16)
        if config.bf16 and not layer_wise:  # the layer-wise optimizer makes main copies of its own shard only
            wrapped = Float16OptimizerWithFloat16Params(muon, config, None, init_state)
        else:
            wrapped = FP32Optimizer(muon, config, init_state)
        if part[0]["is_expert_parallel"] and not layer_wise:
            wrapped.grad_stats_parallel_group = pgs.tp_ep_pp
        optimizers.append(wrapped)
    bf16, config.bf16 = config.bf16, config.bf16 and not layer_wise
    with _only_trainable(trainable, [p for p in trainable if not is_matrix(p)]):
        adam = get_megatron_optimizer(config, model).chained_optimizers
    config.bf16 = bf16
    if layer_wise:
        return LayerWiseDistributedOptimizer(optimizers + adam, config, pgs,
                                             init_state_fn_list=[init_state] * len(optimizers) + [a.init_state_fn for a in adam])
    return ChainedOptimizer(optimizers + adam)
