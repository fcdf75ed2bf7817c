"""A repeated stop signal during the end of a run, with a real process."""
import subprocess
import sys

import pytest

from tests.cli_runs import cli_env
from tests.helpers import SMALL
from k3train.trainer.checkpoint import latest_checkpoint, verify_checkpoint

_TRAIN = ["train", "--config", "configs/k3_tiny.yaml", *SMALL, "train.steps=50", "train.log_interval=1",
          "train.eval_interval=100000", "train.plots=true"]  # the worker signals inside the plots


@pytest.mark.slow
def test_repeated_signals_during_teardown_leave_status_0_and_a_complete_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "tests/faults/teardown_signal_worker.py", "2", *_TRAIN,
                           "--run-dir", str(tmp_path)], env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]  # -15 when the teardown's SIGTERM is not absorbed
    assert "signals sent during the end-of-run plots" in out, out[-3000:]
    step_dir = latest_checkpoint(tmp_path / "checkpoints")
    assert step_dir is not None and step_dir.name.endswith("2"), step_dir
    verify_checkpoint(step_dir, world_size=1)  # raises on a missing or damaged file
