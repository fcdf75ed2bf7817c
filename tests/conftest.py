import os
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


@pytest.fixture
def world1():
    """A one-process gloo group plus its size-1 model-parallel groups (TP=PP=1)."""
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


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")} if root.exists() else {}


@pytest.fixture(autouse=True, scope="session")
def _inductor_cache_in_tmp(tmp_path_factory):
    """torch.compile's inductor writes its cache under the session's temporary directory, not
    the user's (/tmp/torchinductor_$USER): tests write only to temporary directories they own,
    and every run compiles cold, as on a fresh CI machine."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


@pytest.fixture(autouse=True, scope="session")
def _users_runs_untouched():
    """Tests write only to temporary directories: the repository's runs/ (where the README's
    quickstart puts the user's own run) must be the same after the session as before, or
    following the README in order (quickstart, then tests) would mix the two."""
    runs = Path(__file__).resolve().parents[1] / "runs"
    before = _tree(runs)
    yield
    after = _tree(runs)
    changed = sorted(set(before) ^ set(after) | {p for p in before.keys() & after.keys() if before[p] != after[p]})
    assert not changed, f"tests wrote into the repository's runs/: {changed[:10]}"
