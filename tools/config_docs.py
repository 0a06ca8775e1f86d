"""Writes docs/configuration.md from the config dataclasses: every section, every key with its type,
default and docstring (the string under the field in megatron_rl/config/*.py).

    python tools/config_docs.py            # rewrite docs/configuration.md
    python tools/config_docs.py --check    # exit 1 if it is not current (tests/test_docs.py)
"""

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "configuration.md"

HEADER = """# Configuration

Every key of the config tree, generated from the dataclasses in `megatron_rl/config/` by
`python tools/config_docs.py` (a test fails when this page is not current). A recipe sets these
fields in Python; the command line overrides them as `section.field=value`, typed like the field
(`optimizer.lr=3e-4`, `rollout.stop='["\\\\n"]'`, `rewards.weights='{"a": 1}'`); an unknown key or a bad
value is one sentence naming the closest valid key. `python train.py --recipe NAME --print-config`
shows a recipe's values.
"""


def field_docs(cls) -> dict[str, str]:
    """name -> the docstring written under the field in the class body."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def type_name(f: dataclasses.Field) -> str:
    return str(f.type).replace("typing.", "").replace("Literal", "one of ").replace("'", "")


def default_of(f: dataclasses.Field, section) -> str:
    value = getattr(section, f.name)
    return "''" if value == "" else repr(value) if isinstance(value, str) else str(value)


def render() -> str:
    from megatron_rl.config import Config

    cfg = Config()
    parts = [HEADER]
    for top in dataclasses.fields(Config):
        if top.name == "recipe":
            continue
        section = getattr(cfg, top.name)
        cls = type(section)
        docs = field_docs(cls)
        parts.append(f"\n## {top.name}\n")
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            parts.append(" ".join(cls.__doc__.split()) + "\n")
        parts.append("\n| key | type | default | meaning |\n|---|---|---|---|\n")
        for f in dataclasses.fields(cls):
            doc = docs.get(f.name, "").replace("|", "\\|")
            default = default_of(f, section).replace("|", "\\|")
            parts.append(f"| `{top.name}.{f.name}` | {type_name(f).replace('|', 'or')} | `{default}` | {doc} |\n")
    return "".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is not current")
    args = p.parse_args()
    text = render()
    if args.check:
        current = OUT.exists() and OUT.read_text() == text
        print("docs/configuration.md is current" if current else "docs/configuration.md is stale: run "
              "python tools/config_docs.py", file=sys.stderr)
        return 0 if current else 1
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
