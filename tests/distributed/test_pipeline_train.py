"""`k3train train` with the pipeline engine (gloo ranks) follows the single-process run."""
import json

import pytest

from k3train.trainer.loop import train
from tests.k3train.test_train import _cfg
from tests.multiproc import run_multiprocess

STEPS = ["train.steps=3", "train.log_interval=1", "train.eval_interval=3", "model.num_layers=8"]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_rank(rank, world_size, run_dir, overrides):
    train(_cfg(*STEPS, *overrides), run_dir)


@pytest.mark.parametrize("overrides, world", [
    (["parallel.pp=2", "parallel.vpp=2", "train.microbatches=2"], 2),
    (["parallel.pp=2", "train.microbatches=3", "model.attnres.enabled=false"], 2),
    # p2p_backend=gloo: the messages travel on separate gloo groups, one per pipeline (two here).
    (["parallel.pp=2", "parallel.vpp=2", "train.microbatches=2", "pipeline.attnres_transport=naive",
      "pipeline.p2p_backend=gloo"], 4),
], ids=["pp2-vpp2-cached", "pp2-standard-residual", "pp2-dp2-naive-gloo-groups"])
@pytest.mark.slow
def test_pipeline_training_matches_single_process(tmp_path, overrides, world):
    base = [o for o in overrides if not o.startswith(("parallel.", "pipeline."))]
    dp = world // 2
    ref_overrides = [*base, f"train.micro_batch_size={4 * dp}"] if dp > 1 else base
    train(_cfg(*STEPS, *ref_overrides), tmp_path / "ref")
    run_multiprocess(_train_rank, world, tmp_path / "pp", overrides)
    ref, got = _losses(tmp_path / "ref"), _losses(tmp_path / "pp")
    assert len(ref) == len(got) == 3
    # fp32; gradients sum in a different order, and three AdamW steps amplify that a little.
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    first = json.loads((tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["pipeline/bytes_sent"] > 0 and first["pipeline/peak_cache_bytes"] >= 0


@pytest.mark.slow
def test_checkpoint_survives_a_data_parallel_resize(tmp_path, capsys):
    """Saved by DP=2 (two gloo ranks), resumed by one process: the replicated state loads."""
    import torch

    from k3train.trainer.checkpoint import latest_checkpoint

    run_multiprocess(_train_rank, 2, tmp_path, ["train.steps=4"])
    summary = train(_cfg(*STEPS, "train.steps=6"), tmp_path, resume=True, stop_at=5)
    assert "resumed from" in capsys.readouterr().out and summary["steps"] == 5
    state = torch.load(latest_checkpoint(tmp_path / "checkpoints") / "rank_00000.pt", weights_only=False)
    adam_steps = {int(s["step"]) for s in state["optimizer"]["optimizers"][-1]["state"].values()}
    assert adam_steps == {5}, "the optimizer state of the DP=2 run must have been loaded"
