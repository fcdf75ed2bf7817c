"""`k3train train` with expert parallelism (gloo ranks) follows the single-process run."""
import pytest

from tests.distributed.helpers import STEPS, read_losses, train_rank
from tests.helpers import small_cfg
from tests.multiproc import run_multiprocess


@pytest.mark.parametrize("overrides", [
    ["parallel.ep=2"],
    ["parallel.ep=2", "moe.capacity_factor=4.0"],
    ["parallel.ep=2", "parallel.pp=2", "train.microbatches=2"],
], ids=["ep2-dynamic", "ep2-static-capacity", "ep2-pp2"])
@pytest.mark.slow
def test_expert_parallel_training_matches_single_process(tmp_path, overrides, reference_run):
    world = 4 if "parallel.pp=2" in overrides else 2
    base = [o for o in overrides if o.startswith("train.")]
    # EP=2 here means DP=2: the reference sees both ranks' micro-batches as one batch of 8.
    ref_dir = reference_run(small_cfg(*STEPS, *base, "train.micro_batch_size=8"))
    run_multiprocess(train_rank, world, tmp_path / "ep", overrides)
    ref, got = read_losses(ref_dir), read_losses(tmp_path / "ep")
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
