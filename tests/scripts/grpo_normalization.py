"""Under torchrun (or alone): one GRPO optimizer step on a fixed synthetic global batch, each DP rank
taking its contiguous share; prints {"loss", "grad_norm"} on rank 0.

    torchrun --nproc_per_node 2 tests/scripts/grpo_normalization.py MICRO_BATCH_SIZE
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl import platform
    from megatron_rl.training.policy import RLBatch, train_policy
    from megatron_rl.config import Config
    from megatron_rl.training.setup import build_trainee

    launch = platform.init_distributed()
    platform.init_model_parallel(seed=5)
    cfg = Config()
    cfg.model.vocab_size = 20
    cfg.data.micro_batch_size = int(sys.argv[1])
    trainee = build_trainee(cfg)

    g = torch.Generator().manual_seed(0)
    n, s = 32, 12
    batch = {"tokens": torch.randint(0, 20, (n, s), generator=g), "labels": torch.randint(0, 20, (n, s), generator=g),
             "loss_mask": (torch.rand(n, s, generator=g) > 0.4).float(),
             "old_logp": -3.0 + 0.3 * torch.randn(n, s, generator=g), "advantages": torch.randn(n, generator=g),
             "rollout_logp": torch.zeros(n, s), "index": torch.arange(n)}
    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    share = n // size
    mine = {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}
    out, _ = train_policy(trainee, cfg, RLBatch(**mine))
    if launch.rank == 0:
        print(json.dumps({"loss": out["train/loss"], "grad_norm": out["train/grad_norm"]}))
    dist.barrier()
    platform.shutdown()


if __name__ == "__main__":
    main()
