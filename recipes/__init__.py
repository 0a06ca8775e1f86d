"""Recipes: functions returning a Config, registered by name. One module per model family."""

import difflib
import importlib
import pkgutil
from typing import Callable

from megatron_rl.config import Config, ConfigError

_REGISTRY: dict[str, Callable[[], Config]] = {}


def register(fn: Callable[[], Config]) -> Callable[[], Config]:
    """Decorator: the function's name is the recipe's name."""
    _REGISTRY[fn.__name__] = fn
    return fn


def _load_all():
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def list_recipes() -> dict[str, str]:
    """name -> first line of its docstring."""
    _load_all()
    return {name: (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
            for name, fn in sorted(_REGISTRY.items())}


def get_recipe(name: str) -> Config:
    _load_all()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown recipe {name!r}.{hint} Run train.py --list-recipes to see all.")
    cfg = _REGISTRY[name]()
    cfg.recipe = name
    return cfg
