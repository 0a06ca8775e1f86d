# make demo: the built-in default job.  make test: the test suite.  Both create .venv as needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo demo-moe demo-preference demo-distill test install test-fast clean system

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first: the pinned CPU wheel where there is no GPU, so pip never pulls a CUDA build.
$(VENV)/.installed: setup.py $(BIN)/python
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	 else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

# The built-in pipeline: SFT from scratch, then GRPO from its checkpoint (plot: runs/tiny_grpo/plot.png).
demo: install
	$(BIN)/python train.py --recipe tiny_sft
	$(BIN)/python train.py --recipe tiny_grpo

# The same with a tiny Qwen3-MoE model and rollout router replay (plot: runs/tiny_moe_grpo/plot.png).
demo-moe: install
	$(BIN)/python train.py --recipe tiny_moe_sft
	$(BIN)/python train.py --recipe tiny_moe_grpo

# DPO, a reward model, and GRPO against that reward model, each from tiny_sft's checkpoint (run make demo first).
demo-preference: install
	$(BIN)/python train.py --recipe tiny_dpo
	$(BIN)/python train.py --recipe tiny_rm
	$(BIN)/python train.py --recipe tiny_grpo_rm

# On-policy distillation from the same start: a teacher trained further on clean answers, then distilled.
demo-distill: install
	$(BIN)/python train.py --recipe tiny_teacher
	$(BIN)/python train.py --recipe tiny_distill

# System packages some tests use, from Debian, installed as root where apt-get exists (elsewhere those
# tests skip and say why): slurm-wlm and munge for a local Slurm (tests/test_slurm.py), bubblewrap for
# the sandbox that runs a code tool's programs (tests/test_sandbox.py).
system:
	@missing=""; [ -x /usr/sbin/slurmctld ] || missing="slurm-wlm munge"; \
	 command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	 if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	   $$missing) >/dev/null 2>&1 || echo "could not install$$missing: the tests that need them will skip"; fi

# Two workers: many tests wait on process start-up and imports, so two share the two cores well.
# Tests that start from the shared tiny_sft run form one xdist group (one worker trains it).
test: install system
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15 tests

test-fast: install
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup tests -m "not slow"

clean:
	rm -rf runs .pytest_cache
