import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_multiprocess


def _allreduce_sum(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _fail_on_rank_one(rank, world_size):
    assert rank != 1, "rank one fails on purpose"


@pytest.mark.slow
def test_allreduce_over_gloo():
    run_multiprocess(_allreduce_sum, 2)


@pytest.mark.slow
def test_child_failure_reaches_parent():
    with pytest.raises(AssertionError, match="rank one fails on purpose"):
        run_multiprocess(_fail_on_rank_one, 2)
