"""Under torchrun (or alone): several train.py runs one after another in one process group, so
that a layout test pays for process start-up and imports once. Each run is a recipe with its
overrides, set up and dispatched as train.py does it (logging.run_dir names its output).

    torchrun --nproc_per_node 2 tests/scripts/run_recipes.py '[["--recipe", "tiny_dpo", "a.b=c", ...], ...]'

A run whose arguments include --without-fix=NAME runs with that fix of megatron_rl/platform/fixes.py
undone (tests that show a fix is needed).
"""

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WITHOUT_FIX = "--without-fix="


def patched_by(name: str) -> list:
    """(owner, attribute) of each name a fix replaced (the originals are their __wrapped__)."""
    import megatron.core.transformer.multi_latent_attention as mla

    return {"mla_rotary_key_gradient": [(mla, "gather_from_tensor_model_parallel_region"),
                                        (mla.MLASelfAttention, "__init__")]}[name]


@contextmanager
def without_fixes(names: list[str]):
    patched = [(owner, attr, getattr(owner, attr)) for name in names for owner, attr in patched_by(name)]
    for owner, attr, fixed in patched:
        setattr(owner, attr, fixed.__wrapped__)
    try:
        yield
    finally:
        for owner, attr, fixed in patched:
            setattr(owner, attr, fixed)


def main():
    from megatron_rl import platform
    from megatron_rl.algorithms import get_algorithm
    from megatron_rl.config import apply_overrides
    from megatron_rl.platform import job
    from recipes import get_recipe
    from train import parse_args

    launch = platform.init_distributed()
    for argv in json.loads(sys.argv[1]):
        undo = [a.removeprefix(WITHOUT_FIX) for a in argv if a.startswith(WITHOUT_FIX)]
        args = parse_args([a for a in argv if not a.startswith(WITHOUT_FIX)])
        cfg = apply_overrides(get_recipe(args.recipe), args.overrides).validate(world_size=launch.world_size)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        job.init_layout(cfg)  # as train.py lays it out
        with without_fixes(undo):
            get_algorithm(cfg.algorithm.name).run(cfg, Path(cfg.logging.run_dir))
    platform.shutdown()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this module
    main()
