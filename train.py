"""megatron-rl's one entry point: every rank runs it (python, torchrun or srun).

    python train.py --recipe tiny_sft [section.field=value ...] [--print-config]
    torchrun --nproc_per_node 2 train.py --recipe tiny_sft parallel.tp=2
    srun python train.py --recipe NAME
"""

import argparse
import json
import os
import sys
import traceback
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Post-train LLMs on Megatron-Core.",
                                epilog="Overrides are section.field=value, e.g. optimizer.lr=3e-4 train.max_steps=50.")
    p.add_argument("--recipe", help="recipe name (see --list-recipes)")
    p.add_argument("--list-recipes", action="store_true", help="list recipes and exit")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    return p.parse_intermixed_args(argv)  # overrides before or after the flags


def resolve_config(args, launch):
    """The run's Config: the recipe, the overrides, W&B's environment variables, the HF checkpoint's
    architecture and what the model needs, validated; the lines saying what was taken go to stderr."""
    from megatron_rl.config import apply_overrides
    from recipes import check_needs, get_recipe

    cfg = apply_overrides(get_recipe(args.recipe), args.overrides)
    if not args.print_config:
        check_needs(cfg)  # hf_sft: model.hf_path
    notes = cfg.logging.take_environment(os.environ)  # W&B's own variables fill what the config leaves empty
    if cfg.model.hf_path:  # the HF checkpoint's config.json sets the architecture
        from megatron_rl.hf import resolve_model

        cfg.model = resolve_model(cfg.model)
    notes += cfg.fit_to_model({item.split("=", 1)[0] for item in args.overrides})
    if launch.rank == 0:
        for line in notes:
            print(line, file=sys.stderr)
    # a recipe printed from one process is checked against its own layout (a cluster recipe can be read on a
    # laptop); a run is checked against the processes launched
    single_print = args.print_config and launch.world_size == 1
    return cfg.validate(world_size=cfg.parallel.recipe_world_size() if single_print else launch.world_size)


def check_launch(cfg, run_dir: Path):
    """What only a run needs: the device supports the settings, the run directory holds this run (or
    none), and W&B can log in."""
    from megatron_rl.checkpointing import check_same_run
    from megatron_rl.platform.support import check_support

    check_support(cfg)
    check_same_run(run_dir, cfg)
    if cfg.logging.wandb_project:
        from megatron_rl.logging import check_wandb_login

        check_wandb_login(cfg.logging.wandb_mode)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rl.config import ConfigError
    from recipes import recipes_by_family

    if args.list_recipes:
        import textwrap

        for family, recipes in recipes_by_family().items():
            print(f"{family}:")
            for name, doc in recipes.items():
                print(textwrap.fill(doc, 120, initial_indent=f"  {name:28s} ", subsequent_indent=" " * 31))
        return 0
    if not args.recipe:
        print("error: give --recipe NAME (see --list-recipes)", file=sys.stderr)
        return 2
    from megatron_rl import platform

    try:
        launch = platform.read_launch()
    except platform.LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = resolve_config(args, launch)
        run_dir = Path(cfg.logging.run_dir or f"runs/{cfg.recipe}")
        if not args.print_config:
            check_launch(cfg, run_dir)
    except ConfigError as e:
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_json())
        return 0

    fresh_dir = not run_dir.exists()
    platform.keep_freed_memory()
    if cfg.train.threads:  # a run's numbers depend on the thread count on the CPU: recipes pin it
        import torch

        torch.set_num_threads(cfg.train.threads)
    p = cfg.parallel
    try:
        platform.init_distributed(launch)
    except platform.LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if launch.rank == 0:
        for line in (launch.describe() if launch.world_size > 1 else None, platform.check_cuda_connections(p.tp, p.cp)):
            if line:
                print(line, flush=True)
    platform.init_model_parallel(tp=p.tp, pp=p.pp, vpp=p.vpp if p.vpp > 1 else None, cp=p.cp, ep=p.ep,
                                 etp=p.etp or None, seed=cfg.train.seed, cuda_graphs=cfg.rollout.cuda_graphs)
    if cfg.rollout.batch_invariant:  # rollouts and training alike, for the whole run
        platform.use_batch_invariant_kernels()
    if launch.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)  # config.json comes once everything loaded (write_run_assets)
    import torch.distributed as dist

    from megatron_rl.algorithms import get_algorithm
    from megatron_rl.checkpointing import SaveFailed
    from megatron_rl.platform import watchdog
    from megatron_rl.training.step import Diverged

    STOPS = (Diverged, SaveFailed)  # every rank stops at the same step; the checkpoints stay
    USER_ERRORS = (ConfigError, ValueError, FileNotFoundError)  # one sentence; a fresh run directory is removed
    platform.watch_preemption()  # SIGTERM, SIGUSR1: finish the step, save, exit 0; Ctrl-C: the same, exit 130
    platform.tie_process_lifetimes()  # nothing survives a kill -9 of this process or of torchrun
    watchdog.start(dist.distributed_c10d._get_default_store(), launch.rank, launch.world_size,
                   cfg.train.hang_timeout_s)  # a dead, failed or frozen rank stops every rank

    try:
        try:
            final = get_algorithm(cfg.algorithm.name).run(cfg, run_dir)
        except Exception as e:
            if not isinstance(e, STOPS + USER_ERRORS):  # a crash
                if watchdog.peer_failed():  # it follows another rank's failure, which that rank printed
                    os._exit(1)
                if watchdog.running():  # print first: this rank's watchdog, too, ends it once it hears the abort
                    traceback.print_exc()
                    sys.stderr.flush()
                    watchdog.abort(f"failed {launch.rank}: {type(e).__name__}")  # the others stop
                    raise SystemExit(1) from None
            raise
    except STOPS as e:
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        platform.shutdown()
        return 1
    except USER_ERRORS as e:
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
            if fresh_dir:  # leave nothing half-written
                import shutil

                shutil.rmtree(run_dir, ignore_errors=True)
        platform.shutdown()
        return 2
    if launch.rank == 0:
        print(json.dumps({"run_dir": str(run_dir), **final}))
    platform.shutdown()
    return 130 if platform.interrupted() else 0  # Ctrl-C: saved, stopped as a shell expects (128 + SIGINT)


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this module
    sys.exit(main())
