"""Per-rank memory and FLOPs of a recipe's parallel layout, checked in one CPU process.

    python tools/plan.py --recipe qwen3_235b_a22b_grpo [--recipe ...] [--gpu a100|h100|...] [--world-size N]
                         [section.field=value ...]

Builds each pipeline stage's first rank on the meta device under a fake process group of the
recipe's world size and prints, per rank: parameters, bytes of weights, gradients and optimizer
state, an activation estimate, the rollout KV cache, and the total against the GPU's memory, with
a verdict; then the model FLOPs of one step. A recipe that does not fit gets the first settings
that make it fit: the memory settings on its own layout (distributed optimizer, bf16 optimizer
state, full recompute, optimizer CPU offload), else the smallest larger layout found. Exit status
0 if every recipe fits, 1 if one does not, 2 on bad input.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from megatron_rl.config import ConfigError, apply_overrides
    from megatron_rl.plan import GPUS, fit, format_fit, format_plan, plan
    from recipes import get_recipe, recipe_gpu

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, action="append", help="repeat to plan several")
    parser.add_argument("--gpu", choices=sorted(GPUS), help="default: the GPU each recipe is made for (h100 unless "
                        "the recipe says otherwise)")
    parser.add_argument("--world-size", type=int, default=0, help="default: tp x pp x cp x dp of the recipe")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    fits = True
    for name in args.recipe:
        try:
            cfg = apply_overrides(get_recipe(name), args.overrides)
            gpu = args.gpu or recipe_gpu(name)
            result = plan(cfg, args.world_size, gpu)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_plan(result))
        if not result.fits:  # say what would make it fit
            print(format_fit(fit(cfg, args.world_size, gpu), result.world_size))
        print()
        fits &= result.fits
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
