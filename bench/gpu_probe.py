"""What the GPU path does that a benchmark's speed does not show: attention masks and host syncs.

    python bench/gpu_probe.py [--json FILE]

- masks: the rollout's decode attention (platform/paged_attention.py) at bf16 against the math
  backend in fp32 on the same inputs, with the additive mask in the query's dtype (what decode
  uses), in float32 (the dtype that sent CUDA's attention to another kernel: BENCHMARKS.md's
  mismatch of 0.31), and boolean; and training's causal attention without a mask.
- syncs: host synchronizations (platform/syncs.py; on a GPU CUDA's own count, on the CPU the
  operations that would synchronize) per decode step inside the model's forward and in all (megatron's
  engine bookkeeping included), in a training microbatch's forward and backward, and in an optimizer
  step with its report.
Runs on the CPU too (bench/gpu_check.sh --dry-run).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def mask_errors(device) -> dict:
    """Max |output - fp32 math reference| of bf16 decode attention over 64 requests of varied length."""
    from megatron_rl.platform import paged_attention

    g = torch.Generator().manual_seed(0)
    b, heads, groups, d, block, blocks = 64, 8, 4, 64, 32, 8
    lengths = torch.randint(1, block * blocks, (b,), generator=g).to(device)
    q = torch.randn(b, 1, heads, d, generator=g).to(device, torch.bfloat16)
    k_cache, v_cache = (torch.randn(b * blocks, block, groups, d, generator=g).to(device, torch.bfloat16) for _ in "kv")
    table = torch.arange(b * blocks, dtype=torch.int32, device=device).view(b, blocks)
    keys, values = (c.view(b, blocks * block, groups, d).transpose(1, 2) for c in (k_cache, v_cache))
    valid = torch.arange(blocks * block, device=device)[None] < lengths[:, None]  # (b, L)
    qg = q.view(b, groups, heads // groups, d)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(qg.float(), keys.float(), values.float(),
                                                   attn_mask=valid[:, None, None, :]).reshape(b, heads, d)
    additive = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    out = {}
    for name, mask in (("bool", valid[:, None, None, :]), ("bf16", additive.bfloat16()), ("float32", additive)):
        got = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask).reshape(b, heads, d)
        out[f"sdpa_mask_{name}"] = (got.float() - reference).abs().max().item()
    got = paged_attention.flash_attn_with_kvcache(q, k_cache, v_cache, lengths.int(), table,
                                                  max_seqlen_k=int(lengths.max()))
    out["paged_decode"] = (got.reshape(b, heads, d).float() - reference).abs().max().item()
    return out


def sync_counts(work: Path) -> dict:
    """Host syncs per decode step (inside the forward and in all), per training microbatch and per
    optimizer step, bf16, on a 2-layer model."""
    from megatron_rl.platform import syncs
    from megatron_rl.training import step
    from tests.helpers import PROMPTS, bf16_trainee, loss_fn, microbatch_forward, random_char_engine

    _, chunks, engine = random_char_engine(work, max_new_tokens=16, precision="bf16")
    steps = []
    original = engine.engine.step_modern
    engine.engine.step_modern = lambda *a, **k: steps.append(1) or original(*a, **k)
    with syncs.counting(inside=chunks) as inside:
        engine.generate(PROMPTS * 4, seed=0)
    with syncs.counting() as everywhere:
        engine.generate(PROMPTS * 4, seed=0)
    n = len(steps) // 2
    out = {"engine_steps": n, "forward_per_step": inside.count / n, "all_per_step": everywhere.count / n,
           "engine_top": everywhere.report(12).splitlines()}
    for packed in (False, True):
        trainee, micro = bf16_trainee(packed)
        forward = microbatch_forward(trainee, micro[0])
        with syncs.counting() as reads:
            forward().float().logsumexp(-1).sum().backward()
        out[f"train_microbatch_{'packed' if packed else 'rows'}"] = reads.count
    trainee, micro = bf16_trainee(False)
    adam = [s["step"] for sub in trainee.optimizer.chained_optimizers for s in sub.optimizer.state.values()]
    with syncs.counting(host=adam) as reads:
        step.reduce_reports(step.forward_backward(trainee, micro, loss_fn))
        step.optimizer_step(trainee)
    out["optimizer_step_with_report"] = reads.count
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    from megatron_rl import platform

    platform.init_distributed()
    platform.init_model_parallel()
    with tempfile.TemporaryDirectory() as work:
        result = {"device": str(platform.device()), "mask_max_error": mask_errors(platform.device()),
                  "syncs": sync_counts(Path(work))}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
