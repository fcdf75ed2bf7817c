import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


@pytest.fixture
def world1():
    """A one-process gloo group plus megatron-core's model-parallel groups (TP=PP=1)."""
    from k3train.runtime.distributed import init_distributed

    return init_distributed()


@pytest.fixture(autouse=True)
def _seed_and_clean_process_group():
    """Each test starts with seed 0 and without a process group left by an earlier test
    (in-process training initialises a one-rank group; some tests need none)."""
    torch.manual_seed(0)
    yield
    from k3train.ops import kernels
    from k3train.config.schema import KernelsConfig
    from k3train.runtime.distributed import shutdown_distributed

    shutdown_distributed()
    kernels.apply(KernelsConfig(), pipeline_gpu=False)  # a test's run must not steer the next test's kernels
