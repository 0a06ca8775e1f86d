"""The docs: the configuration page is current with the dataclasses, the README stays a short front
page, every relative link of the README and docs/ resolves, and every algorithm has its page."""

import re
import subprocess
import sys

from tests.helpers import ROOT


def test_configuration_page_is_current():
    proc = subprocess.run([sys.executable, "tools/config_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_config_key_is_documented():
    from tools.config_docs import render

    rows = [line for line in render().splitlines() if line.startswith("| `")]
    assert len(rows) > 200
    assert not [row.split("|")[1] for row in rows if not row.rstrip(" |").rsplit("|", 1)[1].strip()]


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert text.index("make demo") < text.index("make test") < text.index("## ")  # the two commands first


def test_links_resolve():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http") and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_algorithm_has_a_page():
    from megatron_rl.algorithms import ALGORITHMS

    pages = {"sft": "sft", "grpo": "grpo", "ppo": "ppo", "dpo": "dpo", "rm": "reward-models", "distill": "distillation"}
    assert set(pages) == set(ALGORITHMS)
    readme = (ROOT / "README.md").read_text()
    for name, page in pages.items():
        assert (ROOT / "docs" / "algorithms" / f"{page}.md").exists() and f"docs/algorithms/{page}.md" in readme
