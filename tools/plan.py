"""Per-rank memory and FLOPs of a recipe's parallel layout, checked in one CPU process.

    python tools/plan.py --recipe qwen3_235b_a22b_grpo [--recipe ...] [--gpu h100] [--world-size N]
                         [section.field=value ...]

Builds each pipeline stage's first rank on the meta device under a fake process group of the
recipe's world size and prints, per rank: parameters, bytes of weights, gradients and optimizer
state, an activation estimate, the rollout KV cache, and the total against the GPU's memory, with
a verdict; then the model FLOPs of one step. Exit status 0 if every recipe fits, 1 if one does
not, 2 on bad input.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from megatron_rl.config import ConfigError, apply_overrides
    from megatron_rl.plan import GPUS, format_plan, plan
    from recipes import get_recipe

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, action="append", help="repeat to plan several")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--world-size", type=int, default=0, help="default: tp x pp x cp x dp of the recipe")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    fits = True
    for name in args.recipe:
        try:
            cfg = apply_overrides(get_recipe(name), args.overrides)
            result = plan(cfg, args.world_size, args.gpu)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_plan(result) + "\n")
        fits &= result.fits
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
