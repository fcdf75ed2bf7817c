"""``k3train train`` at ``parallel.cp=2`` with ZeRO-1 and expert parallelism (gloo ranks): the
run, a checkpoint, a resume, against the one-process run of the same config.

Under CP the ZeRO-1 state is sharded over DP x CP (dense) and the expert-DP group (experts):
each rank holds a different shard, the checkpoint gathers them (``per_param_state``,
collective over those groups) and the resume slices them out again. The logged losses of
steps 1-3 (before the checkpoint) and 4-5 (after the resume) equal the one-process run's to
fp32 rounding (``rel=1e-4``, as the ZeRO-1 tests without CP).
"""
import pytest

from k3train.config import load_config
from k3train.profiling.memory_plan import plan_memory
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


def test_memory_plan_shards_zero1_over_dp_times_cp(world1):
    """The planner's ZeRO-1 state under CP: the dense state over dp x cp ranks, the experts'
    over the expert-DP group (dp x cp / ep), so dp = 1 x cp = 2 plans what dp = 2 x cp = 1 does,
    half of one rank's; ep = 2 at dp = 1 x cp = 2 is a layout (the expert group spans CP)."""
    cfg = load_config("configs/k3_tiny.yaml", ["train.seq_len=64", "train.device=cuda"])
    (alone,), (dp2,), (cp2,) = (plan_memory(cfg, dp=1, cp=1), plan_memory(cfg, dp=2, cp=1),
                                plan_memory(cfg, dp=1, cp=2))
    assert cp2.optimizer_zero1 == dp2.optimizer_zero1 == alone.optimizer_zero1 / 2
    ep = load_config("configs/k3_tiny.yaml", ["train.seq_len=64", "train.device=cuda", "parallel.ep=2"])
    (ep_cp,), (ep_dp,) = plan_memory(ep, dp=1, cp=2), plan_memory(ep, dp=2, cp=1)
    # each rank: half the dense state (ZeRO-1) and half the experts whole (EP, expert-DP of one)
    assert ep_cp.optimizer_zero1 == ep_dp.optimizer_zero1 == alone.optimizer_zero1 / 2
    with pytest.raises(ValueError, match=r"parallel.ep=2 must divide the data-parallel size 1 \(EP"):
        plan_memory(ep, dp=1, cp=1)
