"""Under torchrun with parallel.rollout_ranks > 0: the weight hand-over against a fresh build, for several
recipes and layouts in one process group (the job's split is the first case's).

    torchrun --nproc_per_node 3 tests/scripts/hand_over.py OUT '[["--recipe", "tiny_grpo", "parallel.rollout_ranks=1", "parallel.tp=2"], ...]'

Per case, the training ranks build the recipe's trainee (random weights; LoRA adapters given random values
so that merging matters), hand its weights to the generation ranks, then write them (LoRA merged) as a
checkpoint in OUT/<case>. Each generation rank builds its layout's model afresh, loads that checkpoint, and
compares every tensor with the copy it was handed: the first generation rank prints one JSON line per case,
{"case": i, "tensors": N, "different": [names], "mb": ..., "seconds": ...}.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def train_side(cfg, out: Path):
    from megatron_rl import checkpointing
    from megatron_rl.platform import bridge
    from megatron_rl.rollout.disaggregated import hand_over
    from megatron_rl.training import lora
    from megatron_rl.training.setup import build_trainee

    trainee = build_trainee(cfg)
    generator = torch.Generator().manual_seed(bridge.side().rank)
    with torch.no_grad():
        for adapters in lora.adapter_modules(trainee.model):
            for p in adapters.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    hand_over(trainee.model, cfg.model)
    if cfg.lora.rank:
        lora.merge(trainee.model)
    checkpointing.save_weights(trainee.model, out, cfg.model)
    bridge.bridge().barrier()


def generation_side(cfg, out: Path) -> dict:
    from megatron_rl import checkpointing
    from megatron_rl.hf.weights import local_tensors
    from megatron_rl.platform import bridge
    from megatron_rl.rollout.disaggregated import build_generation_model, hand_over

    chunks = build_generation_model(cfg)
    perf = hand_over(chunks, cfg.model)
    bridge.bridge().barrier()  # the checkpoint is written
    fresh = build_generation_model(cfg)
    checkpointing.load_weights(fresh, out)
    handed = {k: v for c in chunks for k, v in local_tensors(c).items()}
    built = {k: v for c in fresh for k, v in local_tensors(c).items()}
    assert handed.keys() == built.keys()
    return {"tensors": len(handed), "different": sorted(k for k in handed if not torch.equal(handed[k], built[k])),
            "mb": perf["perf/refit_mb"], "seconds": perf["perf/refit_s"]}


def main(out: Path, cases: list[list[str]]):
    from megatron_rl import platform
    from megatron_rl.platform import bridge, job
    from recipes import resolve_config

    launch = platform.read_launch()
    for i, argv in enumerate(cases):
        cfg = resolve_config(argv[1], argv[2:], launch)  # argv: --recipe NAME overrides
        job.start(launch, cfg) if i == 0 else job.init_layout(cfg)
        side = bridge.side()
        if side.name == "train":
            train_side(cfg, out / str(i))
        else:
            result = generation_side(cfg, out / str(i))
            if side.rank == side.first:
                print(json.dumps({"case": i, **result}), flush=True)
    platform.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
