"""Under torchrun: import tiny HF models at a TP/PP/EP layout, save the logits the sharded model
computes (gathered on one rank) and export it back to HF (gathered from every rank).

    torchrun --nproc_per_node 2 tests/scripts/hf_layout.py OUT --tp 2 FAMILY=HF_DIR ...
"""

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def sharded_logits(chunks, tokens: torch.Tensor):
    """Full-vocabulary logits on the last pipeline stage (None elsewhere), through megatron's schedule."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rl.training.step import forward_backward

    captured = []

    def keep_logits(batch, logits):
        captured.append(gather_from_tensor_model_parallel_region(logits))
        return logits.sum() * 0, torch.tensor(1), {}

    micro = [{"tokens": tokens}]
    with torch.no_grad():
        forward_backward(SimpleNamespace(model=chunks), micro, keep_logits, forward_only=True)
    return captured[0] if captured else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("models", nargs="+")
    p.add_argument("--sp", action="store_true", help="sequence parallel (MoE with TP needs it)")
    for name in ("tp", "pp", "ep"):
        p.add_argument(f"--{name}", type=int, default=1)
    args = p.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_rl import platform
    from megatron_rl.config import Config, ParallelConfig
    from megatron_rl.hf import export_hf, import_hf, model_config_from_hf
    from megatron_rl.training.setup import build_model

    launch = platform.init_distributed()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    for item in args.models:
        family, path = item.split("=", 1)
        cfg = Config(model=model_config_from_hf(path), parallel=ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep,
                                                                             sp=args.tp > 1 and args.sp))
        cfg.validate(world_size=launch.world_size)
        platform.init_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep)
        chunks, _ = build_model(cfg, wrap_ddp=False)
        import_hf(chunks, cfg.model, path)
        logits = sharded_logits(chunks, tokens)
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            torch.save(logits[..., :100].clone(), Path(args.out) / f"{family}_logits.pt")
        export_hf(chunks, cfg.model, Path(args.out) / f"{family}_hf", assets=path, max_shard_bytes=40_000)
    platform.shutdown()


if __name__ == "__main__":
    main()
