"""scripts/launch_single_node.sh (through scripts/run_torchrun.sh) at DP=2 on CPU: its exit
status is the workers' outcome, which SLURM requeue logic relies on."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3train.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from tests.k3train.test_train import SMALL

LAUNCH = ["bash", "scripts/launch_single_node.sh", "2", "configs/k3_tiny.yaml"]


def _env(**extra):
    bindir = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHON=sys.executable,
               PATH=f"{bindir}:{os.environ.get('PATH', '')}")
    env.pop("K3TRAIN_FAULTS", None)
    env.update(extra)
    return env


def _finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the launch did not finish in {timeout} s:\n{proc.communicate()[0][-3000:]}")


@pytest.mark.slow
def test_sigterm_to_every_process_saves_and_exits_zero(tmp_path):
    proc = subprocess.Popen([*LAUNCH, "--run-dir", str(tmp_path), *SMALL, "train.steps=100000",
                             "train.log_interval=1"], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 150
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)
    # As SLURM's --signal does: TERM to every process of the job step (wrapper, torchrun, shims,
    # workers), so each worker also gets the copies torchrun and the shim forward.
    os.killpg(proc.pid, signal.SIGTERM)
    out = _finish(proc, timeout=150)
    assert proc.returncode == 0, out[-4000:]
    assert "signal received: saved step" in out and "all 2 workers on this node saved and exited 0" in out
    manifest = verify_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), world_size=2)
    assert manifest["step"] >= 1


@pytest.mark.slow
def test_a_failed_worker_is_reported_as_failure(tmp_path):
    proc = subprocess.Popen([*LAUNCH, "--run-dir", str(tmp_path), *SMALL, "train.steps=3"],
                            env=_env(K3TRAIN_FAULTS="crash@2"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = _finish(proc, timeout=200)
    assert proc.returncode != 0 and "crashing at step 2" in out, out[-3000:]
