"""``logging.tensorboard``: the event files in RUN_DIR/tensorboard/ hold metrics.jsonl's scalars
(the same record feeds both writers), and a missing package is one line naming the pip command."""
import builtins

import pytest

from k3train.errors import UsageError
from k3train.config.schema import WandbConfig
from k3train.trainer.loop import train
from k3train.trainer.metrics import MetricsLogger
from tests.helpers import read_records, small_cfg

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _scalars(log_dir) -> dict[str, dict[int, float]]:
    """tag -> {step: value} read back from the event files (TensorBoard's own reader)."""
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_equal_the_jsonl_records(tmp_path):
    train(small_cfg("train.steps=4", "train.log_interval=1", "train.eval_interval=2",
                    "logging.tensorboard=true"), tmp_path)
    records = read_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    got = _scalars(tmp_path / "tensorboard")
    want: dict[str, dict[int, float]] = {}
    for r in records:
        for key, value in r.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                want.setdefault(key, {})[r["step"]] = value
    assert {"loss", "val_loss", "lr", "tokens_per_s"} <= set(want)
    assert set(got) == set(want)
    assert got["val_loss"].keys() == {2, 4}  # only at eval steps, as in the JSONL
    for key, by_step in want.items():
        assert got[key].keys() == by_step.keys(), key
        for step, value in by_step.items():  # event files store float32
            assert got[key][step] == pytest.approx(value, rel=1e-6, abs=1e-30), (key, step)


def test_off_by_default_writes_no_event_files(tmp_path):
    logger = MetricsLogger(tmp_path, WandbConfig(mode="disabled"), {})
    logger.log({"step": 1, "loss": 2.0})
    logger.close()
    assert not (tmp_path / "tensorboard").exists()
    assert read_records(tmp_path) == [{"step": 1, "loss": 2.0}]


def test_a_resume_hides_the_steps_logged_after_its_checkpoint(tmp_path):
    first = MetricsLogger(tmp_path, WandbConfig(mode="disabled"), {}, tensorboard=True)
    for step in (1, 2, 3):
        first.log({"step": step, "loss": float(step)})
    first.close()
    # resumed from the step-2 checkpoint: step 3 is logged again with its new value
    again = MetricsLogger(tmp_path, WandbConfig(mode="disabled"), {}, resume=True, keep_through=2,
                          tensorboard=True)
    again.log({"step": 3, "loss": 30.0})
    again.close()
    assert _scalars(tmp_path / "tensorboard")["loss"] == {1: 1.0, 2: 2.0, 3: 30.0}
    assert [r["loss"] for r in read_records(tmp_path)] == [1.0, 2.0, 30.0]


def test_missing_package_is_one_line_naming_the_pip_command(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard" or name.startswith("tensorboard"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(UsageError) as err:
        MetricsLogger(tmp_path, WandbConfig(mode="disabled"), {}, tensorboard=True)
    message = str(err.value)
    assert "\n" not in message and "pip install 'k3train[tensorboard]'" in message
    assert "logging.tensorboard=false" in message
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "metrics.jsonl").exists()
