"""`k3train train` with the ZeRO-1 sharded optimizer (gloo ranks) follows the single-process run."""
import pytest

from tests.distributed.helpers import STEPS, read_losses, train_rank
from tests.helpers import small_cfg
from tests.multiproc import run_multiprocess


@pytest.mark.parametrize("overrides, world", [
    (["optim.zero1=true", "optim.name=adamw"], 2),
    (["optim.zero1=true", "optim.name=muon", "parallel.pp=2", "train.microbatches=2"], 4),
    (["optim.zero1=true", "optim.name=muon", "parallel.ep=2"], 2),
], ids=["dp2-adamw", "pp2-dp2-muon", "ep2-dp2-muon"])
@pytest.mark.slow
def test_sharded_optimizer_training_matches_single_process(tmp_path, overrides, world, reference_run):
    base = [o for o in overrides if o.startswith(("train.", "optim."))]
    ref_base = [o for o in base if o != "optim.zero1=true"]
    ref_dir = reference_run(small_cfg(*STEPS, *ref_base, "train.micro_batch_size=8"))
    run_multiprocess(train_rank, world, tmp_path / "zero1", overrides)
    ref, got = read_losses(ref_dir), read_losses(tmp_path / "zero1")
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
