"""Reliability: non-finite steps, a kill during a save, bad input. (SIGTERM to a one-process run:
tests/trainer/test_run_lifecycle.py::test_second_run_on_a_locked_run_dir_refuses_naming_the_holder;
the elastic restart under torchrun:
tests/trainer/test_stop_agreement.py::test_elastic_restart_two_processes_matches_uninterrupted_run.)"""
import json
import signal
import subprocess

import pytest

from k3train.cli import main as cli_main
from k3train.runtime.distributed import check_layout
from k3train.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from k3train.trainer.loop import TrainingStopped, train
from tests.cli_runs import CLI, cli_env as _env, wait_for as _wait_for
from tests.helpers import SMALL, small_cfg, read_records



def test_injected_nan_step_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("K3TRAIN_FAULTS", "nan@2")
    train(small_cfg("train.steps=4", "train.log_interval=1"), tmp_path)
    recs = read_records(tmp_path)
    assert [r["skipped"] for r in recs] == [0, 1, 0, 0]
    manifest = json.loads((latest_checkpoint(tmp_path / "checkpoints") / "manifest.json").read_text())
    assert manifest["optim_step"] == 3, "the poisoned step must not reach the optimizer"


def test_repeated_nan_stops_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("K3TRAIN_FAULTS", "nan@2,nan@3")
    with pytest.raises(TrainingStopped, match="2 consecutive steps had a non-finite loss"):
        train(small_cfg("train.steps=6", "train.max_consecutive_skips=2"), tmp_path)


@pytest.mark.slow
def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([*CLI, "--run-dir", str(tmp_path), "train.steps=8", "checkpoint.interval=2"],
                            env=_env(K3TRAIN_FAULTS="slow_save@4"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    tmp_ckpt = tmp_path / "checkpoints" / ".tmp-step_00000004" / "rank_00000.pt"
    assert _wait_for(tmp_ckpt.exists)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt.name == "step_00000002"
    verify_checkpoint(ckpt, world_size=1)
    # The half-written save is ignored and replaced on resume.
    train(small_cfg("train.steps=4", "checkpoint.interval=2"), tmp_path, resume=True)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000004"


@pytest.mark.parametrize("world, tp, pp, ep, message", [
    (3, 2, 1, 1, "world size 3 is not divisible by parallel.tp*parallel.pp = 2*1"),
    (4, 1, 1, 3, "parallel.ep=3 must divide data-parallel x tensor-parallel size 4"),
])
def test_impossible_parallel_layout(world, tp, pp, ep, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        check_layout(world, tp, pp, ep)


def test_heads_not_divisible_by_tp_is_named(world1):
    from k3train.ops.layers import divide

    with pytest.raises(ValueError, match=r"model.kda.num_heads \(3\) must be divisible by parallel.tp \(2\)"):
        divide(3, 2, "model.kda.num_heads")


def test_missing_dataset_is_one_clear_line(tmp_path, capsys):
    rc = cli_main(["train", "--config", "configs/k3_tiny.yaml", "--run-dir", str(tmp_path), *SMALL,
                   f"data.source={tmp_path}/missing"])
    err = capsys.readouterr().err
    assert rc == 2 and "missing" in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()
