"""The planner's byte counts against what a real tiny model allocates on CPU (one process).

A tiny MoE model in bf16 with the distributed optimizer: the plan's weights, gradients, optimizer
state (after one step) and KV-cache bytes per token, and the real tensors' bytes. Prints one JSON
line: {"name": [planned, real], ...}. Further overrides may follow the output directory (lora.rank=4: the
gradients and optimizer state of the adapters only; optimizer.name=muon: one momentum for each
parameter of the matrices, Adam's state for the rest).
"""

import json
import sys

import torch

from megatron_rl import platform
from megatron_rl.config import apply_overrides
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.plan import kv_bytes_per_token, plan
from recipes import get_recipe

OVERRIDES = ["train.precision=bf16", "optimizer.distributed=true", "model.num_experts=4",
             "model.moe_ffn_hidden_size=64", "model.moe_topk=2"]

if __name__ == "__main__":
    cfg = apply_overrides(get_recipe("tiny_sft"), OVERRIDES + sys.argv[2:])
    planned = plan(cfg, world_size=1).stages[0]

    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.training.setup import build_trainee

    platform.init_distributed()
    platform.init_model_parallel()
    trainee = build_trainee(cfg)
    params = [p for chunk in trainee.model for p in chunk.parameters()]
    for p in params:  # one optimizer step, so that Adam's state exists
        if p.requires_grad:
            p.main_grad.normal_()
    trainee.optimizer.step()
    # MoE: megatron chains one distributed optimizer for dense and one for expert parameters
    optimizers = getattr(trainee.optimizer, "chained_optimizers", [trainee.optimizer])
    states = [t for o in optimizers for s in o.optimizer.state.values() for k, t in s.items()
              if torch.is_tensor(t) and k != "step"]
    mains = [p for o in optimizers for group in getattr(o, "shard_fp32_from_float16_groups", None)
             or o.fp32_from_float16_groups for p in group]  # megatron's distributed or (Muon's) plain bf16 optimizer
    buffers = [b for chunk in trainee.model for b in chunk.buffers + chunk.expert_parallel_buffers]
    tokenizer = build_char_tokenizer("0123456789+=", sys.argv[1])
    engine = RolloutEngine(trainee.model, cfg.model, tokenizer, cfg.rollout, torch.bfloat16)
    kv = engine.context.memory_buffer
    result = {
        "weights": [planned.weights, sum(p.numel() * p.element_size() for p in params)],
        "grads": [planned.grads, sum(b.numel_unpadded * b.grad_data.element_size() for b in buffers)],
        "optimizer": [planned.optimizer, sum(t.numel() * t.element_size() for t in states + mains)],
        "kv_per_token": [kv_bytes_per_token(cfg, cfg.model.num_layers),
                         kv.numel() * kv.element_size() // (kv.shape[2] * kv.shape[3])],
    }
    print(json.dumps(result))
    platform.shutdown()
