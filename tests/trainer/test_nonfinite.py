"""Non-finite guards: no checkpoint with inf/NaN parameters, and a stop message
that names a checkpoint that exists. (Config fields refusing inf/NaN: tests/config/test_config.py.)"""
import pytest
import torch

from k3train.errors import TrainingStopped
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.loop import train
from k3train.trainer.state import TrainState
from tests.helpers import small_cfg


@pytest.mark.slow  # trains 3 tiny steps
def test_non_finite_parameters_are_never_saved(tmp_path, monkeypatch):
    # An update that overflows the weights while loss and gradient were still finite (what
    # optim.lr=inf did): step 3 ends with a NaN weight, and its end-of-run save must refuse.
    real_step, calls = TrainState.train_step, []

    def overflowing_step(self, batch, poison=False):
        out = real_step(self, batch, poison)
        calls.append(out)
        if len(calls) == 3:
            with torch.no_grad():
                self.params[0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(TrainState, "train_step", overflowing_step)
    with pytest.raises(TrainingStopped, match=r"step 3: the parameters hold inf or NaN values, so step 3 was not "
                                              r"saved.*No checkpoint was saved \(checkpoint.interval=0"):
        train(small_cfg("train.steps=3"), tmp_path)
    assert latest_checkpoint(tmp_path / "checkpoints") is None
    assert not list((tmp_path / "checkpoints").glob("step_*"))


@pytest.mark.slow  # trains 3 tiny steps
@pytest.mark.parametrize("interval", [0, 1])
def test_stop_after_non_finite_steps_names_a_checkpoint_that_exists(tmp_path, monkeypatch, interval):
    monkeypatch.setenv("K3TRAIN_FAULTS", "nan@2,nan@3")
    with pytest.raises(TrainingStopped, match="2 consecutive steps had a non-finite loss") as info:
        train(small_cfg("train.steps=6", "train.max_consecutive_skips=2", f"checkpoint.interval={interval}"), tmp_path)
    msg = str(info.value)
    if interval == 0:
        assert "No checkpoint was saved (checkpoint.interval=0 saves only at the end" in msg
        assert latest_checkpoint(tmp_path / "checkpoints") is None
    else:  # steps 1 and 2 were saved (a skipped step keeps the weights, so it saves too)
        named = latest_checkpoint(tmp_path / "checkpoints")
        assert f"The last checkpoint is {named}; resume from it with --resume" in msg and named.is_dir()
