"""Recipes: functions returning a Config, registered by name, one module per model family.

Names are `<model>_<algorithm>[_<hardware>]`; a recipe made for other GPUs than H100 says which
(`@register(gpu="gb200")`), and tools/plan.py checks it on those by default.
"""

import difflib
import importlib
import pkgutil
from typing import Callable

from megatron_rl.config import Config, ConfigError

_REGISTRY: dict[str, Callable[[], Config]] = {}
_GPU: dict[str, str] = {}
_NEEDS: dict[str, tuple[str, ...]] = {}


def register(fn: Callable[[], Config] | None = None, *, gpu: str = "h100", needs: tuple[str, ...] = ()):
    """Decorator, bare or with the GPU the recipe's layout is made for and the keys a run must set
    (`needs`, e.g. model.hf_path): the function's name is the recipe's name."""
    def add(fn):
        _REGISTRY[fn.__name__] = fn
        _GPU[fn.__name__] = gpu
        _NEEDS[fn.__name__] = needs
        return fn

    return add(fn) if fn is not None else add


def _load_all():
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


FAMILIES = ("tiny", "hf", "llama", "qwen", "mixtral", "deepseek", "nemotron")
"""The order --list-recipes shows the families in (any other module after them)."""


def list_recipes() -> dict[str, str]:
    """name -> the first paragraph of its docstring, on one line."""
    _load_all()
    return {name: " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
            for name, fn in sorted(_REGISTRY.items())}


def recipes_by_family() -> dict[str, dict[str, str]]:
    """family (the recipe's module: tiny, llama, qwen, ...) -> {name: its summary}, families in FAMILIES order."""
    families: dict[str, dict[str, str]] = {}
    for name, doc in list_recipes().items():
        families.setdefault(_REGISTRY[name].__module__.rsplit(".", 1)[-1], {})[name] = doc
    rank = {family: i for i, family in enumerate(FAMILIES)}
    return dict(sorted(families.items(), key=lambda item: (rank.get(item[0], len(FAMILIES)), item[0])))


def recipe_gpu(name: str) -> str:
    """The GPU a recipe's layout is made for (h100 unless it says otherwise)."""
    _load_all()
    return _GPU.get(name, "h100")


def check_needs(cfg: Config):
    """A run of a recipe that needs keys set (hf_sft: model.hf_path) is refused in one sentence without them."""
    for key in _NEEDS.get(cfg.recipe, ()):
        section, name = key.split(".")
        if not getattr(getattr(cfg, section), name):
            raise ConfigError(f"recipe {cfg.recipe} needs {key}: add {key}=... to the command line "
                              f"(--print-config shows the recipe without it).")


def get_recipe(name: str) -> Config:
    _load_all()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown recipe {name!r}.{hint} Run train.py --list-recipes to see all.")
    cfg = _REGISTRY[name]()
    cfg.recipe = name
    return cfg


def print_recipes() -> None:
    """--list-recipes: each family's recipes with their summaries."""
    import textwrap

    for family, recipes in recipes_by_family().items():
        print(f"{family}:")
        for name, doc in recipes.items():
            print(textwrap.fill(doc, 120, initial_indent=f"  {name:28s} ", subsequent_indent=" " * 31))


def resolve_config(recipe: str, overrides: list[str], launch, print_only: bool = False) -> Config:
    """A run's Config: the recipe, the overrides, W&B's environment variables, the HF checkpoint's
    architecture and what the model needs, validated; the lines saying what was taken go to stderr. A
    recipe only printed from one process is checked against its own layout (a cluster recipe can be
    read on a laptop); a run is checked against the processes launched."""
    import os
    import sys

    from megatron_rl.config import apply_overrides

    cfg = apply_overrides(get_recipe(recipe), overrides)
    if not print_only:
        check_needs(cfg)  # hf_sft: model.hf_path
    notes = cfg.logging.take_environment(os.environ)  # W&B's own variables fill what the config leaves empty
    if cfg.model.hf_path:  # the HF checkpoint's config.json sets the architecture
        from megatron_rl.hf import resolve_model

        cfg.model = resolve_model(cfg.model)
    notes += cfg.fit_to_model({item.split("=", 1)[0] for item in overrides})
    if launch.rank == 0:
        for line in notes:
            print(line, file=sys.stderr)
    single_print = print_only and launch.world_size == 1
    return cfg.validate(world_size=cfg.parallel.recipe_world_size() if single_print else launch.world_size)
