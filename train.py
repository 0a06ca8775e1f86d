"""megatron-rl's one entry point: every rank runs it (python, torchrun or srun).

    python train.py --recipe tiny_sft [section.field=value ...] [--print-config]
    torchrun --nproc_per_node 2 train.py --recipe tiny_sft parallel.tp=2
    srun python train.py --recipe NAME

It reads the recipe and the overrides into a checked Config, starts the platform (process groups, the
parallel layout, the watchdog), and runs the algorithm's loop (megatron_rl/algorithms/<name>.py).
"""

import argparse
import sys
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Post-train LLMs on Megatron-Core.",
                                epilog="Overrides are section.field=value, e.g. optimizer.lr=3e-4 train.max_steps=50.")
    p.add_argument("--recipe", help="recipe name (see --list-recipes)")
    p.add_argument("--list-recipes", action="store_true", help="list recipes and exit")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    return p.parse_intermixed_args(argv)  # overrides before or after the flags


def main(argv=None) -> int:
    args = parse_args(argv)
    from recipes import print_recipes, resolve_config

    if args.list_recipes or not args.recipe:
        print_recipes() if args.list_recipes else print("error: give --recipe NAME (see --list-recipes)", file=sys.stderr)
        return 0 if args.list_recipes else 2
    from megatron_rl import platform
    from megatron_rl.config import UserError
    from megatron_rl.platform import job
    from megatron_rl.training.run import check_launch

    launch = None
    try:
        launch = platform.read_launch()
        cfg = resolve_config(args.recipe, args.overrides, launch, args.print_config)
        if args.print_config:
            print(cfg.to_json())
            return 0
        run_dir = Path(cfg.logging.run_dir or f"runs/{cfg.recipe}")
        check_launch(cfg, run_dir)
        fresh_dir = not run_dir.exists()
        job.start(launch, cfg)
    except UserError as e:
        if launch is None or launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if launch.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)  # config.json comes once everything loaded (write_run_assets)
    from megatron_rl.algorithms import get_algorithm

    return job.finish(lambda: get_algorithm(cfg.algorithm.name).run(cfg, run_dir), launch, run_dir, fresh_dir)


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this module
    sys.exit(main())
