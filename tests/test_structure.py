"""The package's structure: no import cycles and no import up the layers (read from the source, every
import, at module level or inside a function), devices asked of the platform only, and every config
section found by its class's name."""

import ast
import dataclasses
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("megatron_rl", "model_providers", "recipes")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports. `from a import b` counts as importing a.b where that is a
    module, else a (a package's __init__ is not imported implicitly by its submodules: that is Python's
    order of loading, not a dependency)."""
    paths = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    found |= {full} if full in paths else {base} if base in paths else set()
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 80 and "megatron_rl.config" in graph["megatron_rl.training.lora"]
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + ": " + ", ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) for c in found)


LAYERS = [("megatron_rl", "megatron_rl.config", "megatron_rl.losses"), ("megatron_rl.platform",), ("model_providers",),
          ("megatron_rl.data", "megatron_rl.hf", "megatron_rl.checkpointing", "megatron_rl.logging"),
          ("megatron_rl.training",), ("megatron_rl.rollout", "megatron_rl.environments"),
          ("megatron_rl.algorithms", "megatron_rl.plan", "recipes")]
"""docs/architecture.md's layers, bottom to top: a module imports from its own layer or below."""


def layer(module: str) -> int:
    """The layer of the longest prefix of `module` that LAYERS names."""
    found = [(len(name), i) for i, names in enumerate(LAYERS) for name in names
             if module == name or module.startswith(name + ".")]
    return max(found)[1]


def test_imports_go_down_the_layers():
    graph = import_graph()
    upward = [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if layer(b) > layer(a)]
    assert not upward, "imports up the layers:\n" + "\n".join(upward)
    assert layer("megatron_rl.training.policy") == 4 and layer("megatron_rl.losses") == 0


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_section_is_named_by_its_class():
    from megatron_rl.config import Config
    from megatron_rl.config.base import section_of

    cfg = Config()
    for f in dataclasses.fields(Config):
        if f.name != "recipe":
            assert section_of(getattr(cfg, f.name)) == f.name


def test_devices_are_asked_of_the_platform_only():
    """torch.cuda is read in megatron_rl/platform/ only (the rest asks platform.traits(), has_cuda(),
    device()); every other module of the package, the model providers and recipes leave it alone."""
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.is_relative_to(ROOT / "megatron_rl" / "platform"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "cuda" and getattr(node.value, "id", "") == "torch":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"torch.cuda outside platform/: {found}"
