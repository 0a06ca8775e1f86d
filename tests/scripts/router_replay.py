"""Rollout router replay (R3) on a tiny Qwen3-MoE model, in any parallel layout (torchrun).

    torchrun --nproc_per_node N tests/scripts/router_replay.py OUT_DIR [section.field=value ...] [--episodes]

(--episodes: the rollout is three-turn episodes, tests/test_episodes.py's Relay environment)

1. roll out with the routing tape recording;
2. the old-policy forward, comparing its own routing with the rollout's token by token (this checks
   the arrangement: padding, microbatches, pipeline stages, CP/SP splits): no difference;
3. the same forward replaying the rollout's routes: logprobs equal to the rollout's;
4. one GRPO optimizer step with replay and a large learning rate (the backward replays too, also
   when activation recompute re-runs the forward);
5. fresh routing now differs from the rollout's, while replay still uses exactly its experts.
Writes OUT_DIR/result_rank{R}.json.
"""

import json
import os
import sys
from pathlib import Path

import torch

from megatron_rl import platform
from megatron_rl.config import apply_overrides
from megatron_rl.data.tokenizer import build_char_tokenizer
from recipes import get_recipe


EPISODES = "--episodes"
UNEVEN = "--uneven"  # data-parallel rank 0's samples (episodes) end after 2 tokens (10 tokens), the others' later


def main():
    out_dir, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = apply_overrides(get_recipe("tiny_moe_grpo"), ["checkpoint.load=", "optimizer.lr=0.05", "optimizer.min_lr=0.05",
                                                         "data.micro_batch_size=8", *(o for o in overrides if o not in (EPISODES, UNEVEN))])
    tokenizer = build_char_tokenizer("0123456789+=", out_dir / f"tokenizer{os.environ.get('RANK', '0')}")
    cfg.model.vocab_size = len(tokenizer)
    launch = platform.init_distributed()
    cfg.fit_to_model({o.split("=", 1)[0] for o in overrides if o not in (EPISODES, UNEVEN)})  # as train.py: expert parallelism's dispatcher
    cfg.validate(launch.world_size)
    p = cfg.parallel
    platform.init_model_parallel(tp=p.tp, pp=p.pp, vpp=p.vpp if p.vpp > 1 else None, cp=p.cp, ep=p.ep, etp=p.etp or None)

    from megatron.core import parallel_state as ps

    from megatron_rl.training.policy import RLBatch, logprobs_of, train_policy
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.training.routing import RoutingTape
    from megatron_rl.training.setup import build_trainee

    trainee = build_trainee(cfg)
    engine = RolloutEngine(trainee.model, cfg.model, tokenizer, cfg.rollout, torch.float32)
    tape = RoutingTape(trainee.model, cfg.model.moe_topk, p.sp)
    g = torch.Generator().manual_seed(0)
    prompts = [[tokenizer.bos_token_id] + torch.randint(3, 15, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 8, (8,), generator=g)]
    short = UNEVEN in overrides and ps.get_data_parallel_rank() == 0  # its expert group's ranks end apart
    dummies = []
    wrapper = engine.controller.inference_wrapped_model
    wrapper.dummy_forward = lambda forward=wrapper.dummy_forward: dummies.append(1) or forward()
    if EPISODES in overrides:  # three-turn episodes: later turns' prefills replay earlier tokens' routes
        from megatron_rl.environments import EnvRunner
        from megatron_rl.rollout.episodes import run_episodes
        from tests.test_episodes import Relay

        runner = EnvRunner(Relay())
        rollout = run_episodes(engine, runner, tokenizer, prompts, [{}] * len(prompts), n=2, seed=0, max_turns=3,
                               budget=10 if short else cfg.data.seq_length + 1, tape=tape).rollout
        runner.close()
    else:
        rollout = engine.generate(prompts, n=2, seed=0, tape=tape, max_new_tokens=[2] * len(prompts) if short else None)
    packed = RLBatch.of(rollout, cfg.data.seq_length, tokenizer.pad_token_id, routes=True)  # top-p / top-k: kept sets
    packed.advantages = torch.randn(len(rollout.routes), generator=g)
    batch = packed.tensors()
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    mask = batch["loss_mask"] > 0

    def counts():
        c = tape.take_counts()
        t = torch.tensor(list(c.values()), dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return dict(zip(c, t.tolist()))

    result = {"recorded_positions": int(sum((r >= 0).all(-1).all(-1).sum() for r in rollout.routes)),
              "filtered": bool(rollout.thresholds), "dummy_forwards": len(dummies),
              "observation_tokens": int(sum(m.count(0.0) for m in rollout.masks))}
    logprobs_of(trainee.model, batch, cfg, tape, replay=False)
    result["before_update_observe"] = counts()
    replayed = logprobs_of(trainee.model, batch, cfg, tape, replay=True, filtered=True)
    result["before_update_replay"] = counts()
    result["logprob_diff_replay"] = (replayed - batch["rollout_logp"]).abs()[mask].max().item() if last else 0.0

    batch["old_logp"] = replayed
    used = []  # the experts every replaying router call returned, with what was queued for it
    originals = {}
    for layer in tape.layers:
        originals[layer] = layer.get_replay_topk

        def spy(*args, _layer=layer, **kwargs):
            queued = _layer.forward[0] if _layer.forward and torch._C._current_graph_task_id() == -1 else None
            probs, experts = originals[_layer](*args, **kwargs)
            if queued is not None:
                used.append(bool(((experts == queued[0]).all(-1) | ~queued[1]).all()))
            return probs, experts
        layer.get_replay_topk = spy
    train_policy(trainee, cfg, RLBatch(**batch), tape)
    result["train_replay"] = counts()
    result["train_forwards_used_recorded"] = all(used) and len(used) > 0

    logprobs_of(trainee.model, batch, cfg, tape, replay=False)
    result["after_update_observe"] = counts()
    used.clear()
    logprobs_of(trainee.model, batch, cfg, tape, replay=True)
    result["after_update_replay"] = counts()
    result["after_update_used_recorded"] = all(used) and len(used) > 0
    (out_dir / f"result_rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    platform.shutdown()


if __name__ == "__main__":
    main()
