"""How a run ends (issue 43 item 10, with issue 44's signal cases): ``run.lock`` is removed when
a run finishes, fails or is stopped, but never while another live run holds it; after a stop
signal the last line says where the run stopped and saved, not "done:"."""
import os
import signal

import pytest

from k3train.errors import RunDirError
from k3train.trainer import faults
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.loop import train
from k3train.trainer.run_lock import RunDirLock, _same_file
from tests.helpers import small_cfg

STEPS = ["train.log_interval=1", "train.eval_interval=100", "checkpoint.interval=0"]


@pytest.mark.slow  # trains a tiny model three times (a few seconds each)
def test_run_lock_goes_with_a_finished_failed_or_stopped_run(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    train(small_cfg("train.steps=2", *STEPS), run)
    out = capsys.readouterr().out
    assert "[k3train] done: step 2" in out and not (run / "run.lock").exists()

    with pytest.raises(RunDirError, match="past train.steps=1"):  # fails after taking the lock
        train(small_cfg("train.steps=1", *STEPS), run, resume=True)
    assert not (run / "run.lock").exists()

    # A stop signal at step 3 of 5 (SIGINT, as a Ctrl-C): the step is saved, no "done:".
    crash = faults.maybe_crash
    monkeypatch.setattr(faults, "maybe_crash",
                        lambda step: os.kill(os.getpid(), signal.SIGINT) if step == 3 else crash(step))
    capsys.readouterr()
    summary = train(small_cfg("train.steps=5", *STEPS), run, resume=True)
    out = capsys.readouterr().out
    assert summary["stopped_by_signal"] and summary["steps"] == 3
    assert latest_checkpoint(run / "checkpoints").name == "step_00000003"
    assert "done:" not in out, out
    assert f"stopped by a signal at step 3 of 5, saved to {run / 'checkpoints'}" in out
    assert "--resume" in out.splitlines()[-1]
    assert not (run / "run.lock").exists()


def test_a_refused_run_leaves_the_holders_lock(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(RunDirError, match="in use by another run"):
            with RunDirLock(tmp_path):
                pass
        assert (tmp_path / "run.lock").is_file()  # the live holder's file stays
        assert str(os.getpid()) in (tmp_path / "run.lock").read_text()
    assert not (tmp_path / "run.lock").exists()


def test_a_lock_file_removed_under_a_waiting_opener_is_not_taken(tmp_path):
    """A run that opened run.lock just before its holder removed it must not count the old
    (unlinked) file as the lock: the path no longer names it."""
    path = tmp_path / "run.lock"
    with RunDirLock(tmp_path):
        late = os.open(path, os.O_RDWR)
        assert _same_file(late, path)
    try:
        assert not _same_file(late, path)  # removed: a lock on it would exclude no one
        with RunDirLock(tmp_path):  # the next run locks a new file
            assert path.is_file() and not _same_file(late, path)
    finally:
        os.close(late)
