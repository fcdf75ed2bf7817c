"""``k3train train`` at ``parallel.cp=2`` with ZeRO-1 and expert parallelism (gloo ranks): the
run, a checkpoint, a resume, against the one-process run of the same config.

Under CP the ZeRO-1 state is sharded over DP x CP (dense) and the expert-DP group (experts):
each rank holds a different shard, the checkpoint gathers them (``per_param_state``,
collective over those groups) and the resume slices them out again. The logged losses of
steps 1-3 (before the checkpoint) and 4-5 (after the resume) equal the one-process run's to
fp32 rounding (``rel=1e-4``, as the ZeRO-1 tests without CP).
"""
import pytest

from k3train.trainer.loop import train
from tests.distributed.helpers import read_losses
from tests.helpers import small_cfg
from tests.multiproc import run_multiprocess

STEPS = ["train.steps=5", "train.log_interval=1", "train.eval_interval=5", "checkpoint.interval=0"]


def _train_rank(rank, world_size, run_dir, overrides, stop_at, resume):
    train(small_cfg(*STEPS, *overrides), run_dir, resume=resume, stop_at=stop_at)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp2_ep2_zero1_trains_and_resumes_as_one_process(tmp_path):
    """cp = ep = 2 in a world of two (the expert group is the CP group), ZeRO-1 with Muon,
    the aux loss (its statistics over both CP ranks); stopped after step 3 and resumed."""
    common = ["optim.name=muon", "moe.balancing=aux_loss"]
    train(small_cfg(*STEPS, *common), tmp_path / "ref")
    layout = [*common, "optim.zero1=true", "parallel.cp=2", "parallel.ep=2"]
    run_multiprocess(_train_rank, 2, tmp_path / "cp", layout, 3, False)
    run_multiprocess(_train_rank, 2, tmp_path / "cp", layout, None, True)
    ref, got = read_losses(tmp_path / "ref"), read_losses(tmp_path / "cp")
    assert len(ref) == 5 and len(got) == 5
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
