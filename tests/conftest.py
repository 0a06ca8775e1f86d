import pytest

from tests.helpers import free_port


@pytest.fixture(scope="module")
def one_process():
    """A single-process gloo group and megatron's parallel state, for in-process tests."""
    from megatron_rl import platform

    platform.init_distributed(platform.Launch(master_port=free_port()))
    platform.init_model_parallel()
    yield
    platform.shutdown()
