"""Run a function on megatron.core modules as they are imported (or at once, if already imported).

The platform's patches go through here, so they hold whatever imports megatron first.
"""

import contextlib
import importlib.abc
import importlib.machinery
import sys
from typing import Callable

_BY_NAME: dict[str, list[Callable]] = {}
_EVERY: list[Callable] = []  # run on every megatron.core module
_installed = False


def _run(module):
    for fn in _EVERY:
        fn(module)
    for fn in _BY_NAME.get(module.__name__, []):
        fn(module)


_SUBSTITUTES: dict[str, str] = {}  # megatron module -> ours, imported in its place
_HIDDEN: dict[str, tuple[str, ...]] = {}  # megatron module -> top-level modules it must not see


@contextlib.contextmanager
def _absent(names: tuple[str, ...]):
    """Within the block, `import name` raises ImportError for each name not imported yet."""
    hidden = [n for n in names if n not in sys.modules]
    for n in hidden:
        sys.modules[n] = None
    try:
        yield
    finally:
        for n in hidden:
            if sys.modules.get(n, ...) is None:
                del sys.modules[n]


class _Alias(importlib.abc.Loader):
    """Loads one of our modules under a megatron module's name."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron.core"):
            return None
        if name in _SUBSTITUTES:
            return importlib.machinery.ModuleSpec(name, _Alias(_SUBSTITUTES[name]))
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            with _absent(_HIDDEN.get(name, ())):
                exec_module(module)
            _run(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _install():
    global _installed
    if not _installed:
        sys.meta_path.insert(0, _PatchOnImport())
        _installed = True


def on_import(name: str, fn: Callable):
    """Call fn(module) once megatron module `name` is loaded."""
    _install()
    _BY_NAME.setdefault(name, []).append(fn)
    if sys.modules.get(name) is not None:
        fn(sys.modules[name])


def on_every_import(fn: Callable):
    """Call fn(module) for every megatron.core module, loaded now or later."""
    _install()
    _EVERY.append(fn)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            fn(module)


def substitute(name: str, ours: str):
    """Import our module `ours` wherever megatron imports module `name` (for a module that cannot
    even be imported here, such as one importing Triton at the top)."""
    _install()
    _SUBSTITUTES[name] = ours


def hide(name: str, *modules: str):
    """While megatron module `name` executes, its optional imports of `modules` fail as if they
    were not installed (unless something imported them already)."""
    _install()
    _HIDDEN[name] = (*_HIDDEN.get(name, ()), *modules)
