import os

import pytest
import torch

from tests.helpers import threads

# Under `make test` two pytest workers share the cores: each worker, and what it starts without
# an explicit thread count, uses its share.
os.environ["OMP_NUM_THREADS"] = threads()
torch.set_num_threads(int(threads()))


# The same suite on a GPU (make test there): a test marked cpu_only("why") is skipped where CUDA runs;
# one marked fp32("why") asserts bounds that hold in fp32, so its recipes and models run in fp32 there
# too (train.precision=auto is bf16 on a GPU: fp32_bounds). On the CPU both change nothing.
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {marker.args[0]}"))


@pytest.fixture(autouse=True)
def fp32_bounds(request, monkeypatch):
    """A test marked fp32: its train.py runs get train.precision=fp32 where CUDA runs (helpers), and so do
    the models it builds in this process with train.precision=auto."""
    from tests import helpers

    helpers.FP32_BOUNDS = request.node.get_closest_marker("fp32") is not None
    if helpers.FP32_BOUNDS and torch.cuda.is_available():
        from megatron_rl.training import setup

        chosen = setup.compute_dtype
        monkeypatch.setattr(setup, "compute_dtype",
                            lambda cfg: torch.float32 if cfg.train.precision == "auto" else chosen(cfg))
    yield
    helpers.FP32_BOUNDS = False


@pytest.fixture(scope="module")
def one_process():
    """A single-process gloo group and megatron's parallel state, for in-process tests."""
    from megatron_rl import platform

    platform.init_distributed(platform.Launch())
    platform.init_model_parallel()
    yield
    platform.shutdown()


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """The tiny_sft recipe trained in full (about two minutes): GRPO tests start from it (they share
    the xdist group "tiny_sft", so one worker trains it once)."""
    from tests.helpers import run_train

    run = tmp_path_factory.mktemp("tiny_sft")
    run_train(["--recipe", "tiny_sft", "train.eval_every=0", "logging.progress=false", "logging.tensorboard=false",
               f"logging.run_dir={run}"])
    return run
