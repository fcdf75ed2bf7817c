"""Fine-tuning from a checkpoint (``train.init_from``), the data-source warning on resume, and
``k3train eval`` against the trainer's own validation loss."""
import json

import pytest
import torch

from k3train.cli import main as cli_main
from k3train.errors import CheckpointError
from k3train.runtime.distributed import init_distributed, shutdown_distributed
from k3train.model.model import build_model
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.data import build_data
from k3train.trainer.loop import train
from k3train.trainer.state_io import consolidated_state
from tests.helpers import small_cfg

STEPS = ["train.log_interval=1", "train.eval_interval=2"]


def read_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_init_from_takes_weights_only(tmp_path, capsys):
    train(small_cfg(*STEPS, "train.steps=2"), tmp_path / "base")
    tuned_cfg = small_cfg(*STEPS, "train.steps=1", f"train.init_from={tmp_path / 'base'}", "train.seed=7")
    train(tuned_cfg, tmp_path / "tuned")
    out = capsys.readouterr().out
    assert "fine-tuning: weights from" in out and "fresh optimizer, lr schedule and data position" in out

    # Reference: the base run's weights in a plain one-process model, on the tuned run's first batch.
    init_distributed()
    try:
        model = build_model(tuned_cfg)
        weights = consolidated_state(latest_checkpoint(tmp_path / "base" / "checkpoints"))["model"]
        missing = model.load_state_dict(weights, strict=False).missing_keys
        assert all(k.endswith("_extra_state") for k in missing)
        batch = next(build_data(tuned_cfg).train)
        with torch.no_grad():
            want = model(batch[:, :-1], batch[:, 1:]).item()
    finally:
        shutdown_distributed()
    assert read_records(tmp_path / "tuned")[0]["loss"] == pytest.approx(want, rel=1e-6)

    tuned = latest_checkpoint(tmp_path / "tuned" / "checkpoints")
    manifest = json.loads((tuned / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["optim_step"] == 1  # a fresh optimizer, one update
    data = torch.load(tuned / "rank_00000.pt", weights_only=False)["data"]
    assert data["position"] == tuned_cfg.train.micro_batch_size  # a fresh data position, one batch read


@pytest.mark.slow
def test_resume_on_other_data_is_refused_or_warns_naming_both_sources(tmp_path, capsys):
    train(small_cfg(*STEPS, "train.steps=3"), tmp_path, stop_at=1)
    with pytest.raises(CheckpointError, match="data.source=embedded .* in the checkpoint, data.source=mqar .* now"
                                              ".*train.allow_data_change=true"):
        train(small_cfg(*STEPS, "train.steps=3", "data.source=mqar"), tmp_path, resume=True, stop_at=2)
    capsys.readouterr()
    allow = "train.allow_data_change=true"
    train(small_cfg(*STEPS, "train.steps=3", "data.source=mqar", allow), tmp_path, resume=True, stop_at=2)
    out = capsys.readouterr().out
    assert "WARNING" in out and "data.source=embedded" in out and "data.source=mqar" in out
    train(small_cfg(*STEPS, "train.steps=3", "data.source=mqar"), tmp_path, resume=True)
    assert "WARNING" not in capsys.readouterr().out  # step 2 was saved by the mqar run


@pytest.mark.slow
def test_eval_command_equals_the_trainers_validation_loss(tmp_path, capsys):
    train(small_cfg(*STEPS, "train.steps=2"), tmp_path)
    val_loss = read_records(tmp_path)[-1]["val_loss"]
    capsys.readouterr()
    assert cli_main(["eval", "--checkpoint", str(tmp_path / "checkpoints"), "--batches", "2",
                     "logging.progress_bar=false"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    loss, ppl, bpb = (float(part.split()[-1]) for part in line.split("|"))
    assert loss == pytest.approx(val_loss, abs=1e-4)  # printed with 4 decimals
    assert ppl == pytest.approx(torch.tensor(val_loss).exp().item(), rel=1e-3)
    assert bpb == pytest.approx(val_loss / torch.log(torch.tensor(2.0)).item(), abs=1e-3)

    from k3train.trainer.evaluate import evaluate_checkpoint

    exact = evaluate_checkpoint(tmp_path / "checkpoints", batches=2, progress=False)
    assert exact["loss"] == pytest.approx(val_loss, rel=1e-6) and exact["batches"] == 2
    assert cli_main(["eval", "--checkpoint", str(tmp_path / "checkpoints"), "--batches", "-1"]) == 2
    assert "--batches -1" in capsys.readouterr().err
