"""One-process run lifecycle: the run-directory lock, metrics on resume, wandb keys, process exit."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from k3train.cli import main as cli_main
from k3train.errors import RunDirError
from k3train.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from k3train.trainer.run_lock import RunDirLock
from k3train.trainer.stop import SignalGuard as _SignalGuard
from tests.cli_runs import CLI, cli_env as _env, wait_for as _wait_for
from tests.helpers import SMALL, small_cfg, read_records



@pytest.mark.slow
def test_second_run_on_a_locked_run_dir_refuses_naming_the_holder(tmp_path, capsys):
    """A run in a subprocess holds the lock; a second run in this process is refused in one line
    naming the holder; SIGTERM then makes the first save and exit 0, releasing the lock."""
    first = subprocess.Popen([*CLI, "--run-dir", str(tmp_path), "train.steps=100000", "train.log_interval=1"],
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait_for(lambda: len((tmp_path / "metrics.jsonl").read_text().splitlines()) >= 2
                         if (tmp_path / "metrics.jsonl").exists() else False)
        config_before = (tmp_path / "config.yaml").read_text()
        rc = cli_main(["train", "--config", "configs/k3_tiny.yaml", "--run-dir", str(tmp_path), *SMALL,
                       "train.steps=2", "model.hidden_size=32"])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"PID {first.pid} on host {socket.gethostname()}" in err and "--run-dir" in err
        # The refused run touched nothing: the first run's config and metrics are intact.
        assert (tmp_path / "config.yaml").read_text() == config_before
        steps = [r["step"] for r in read_records(tmp_path)]
        assert steps[:2] == [1, 2] and steps == list(range(1, len(steps) + 1))
    finally:
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
    # SIGTERM: the first run saves a checkpoint that verifies and exits 0 (this launch was also
    # test_reliability.py's test_sigterm_saves_and_exits_zero, merged here).
    assert first.returncode == 0, out
    manifest = verify_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), world_size=1)
    assert 1 <= manifest["step"] < 100000 and "signal received" in out, out
    # The lock went with its holder: the directory is usable again.
    with RunDirLock(tmp_path):
        pass


def test_lock_is_exclusive_and_released(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(RunDirError, match=rf"PID {os.getpid()} on host {socket.gethostname()}"):
            with RunDirLock(tmp_path):
                pass
        with RunDirLock(tmp_path, enabled=False):  # ranks other than 0 never lock
            pass
    with RunDirLock(tmp_path):  # released on exit
        pass
    assert not (tmp_path / "run.lock").exists(), "a run that ends removes its lock file"


@pytest.mark.slow
def test_resume_drops_metrics_logged_after_the_checkpoint(tmp_path):
    from k3train.trainer.loop import train

    args = ["train.steps=4", "train.log_interval=1", "checkpoint.interval=2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(small_cfg(*args), ref)
    train(small_cfg(*args), run, stop_at=3)
    # As a run killed after logging step 3 and before its save: the newest checkpoint is step 2.
    (run / "checkpoints" / "latest").write_text("step_00000002")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 9')  # and the kill tore the line it was writing
    train(small_cfg(*args), run, resume=True)
    recs = read_records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["loss"] for r in recs] == [r["loss"] for r in read_records(ref)]


class _RecordingWandb:
    def __init__(self):
        self.calls = []

    def log(self, values, step):
        self.calls.append((step, values))


def test_wandb_images_do_not_replace_scalar_series(tmp_path, monkeypatch):
    import wandb

    from k3train.config.schema import WandbConfig
    from k3train.trainer.metrics import MetricsLogger

    monkeypatch.setattr(wandb, "Image", lambda path: ("image", path))
    png = tmp_path / "loss.png"
    png.write_bytes(b"\x89PNG")
    logger = MetricsLogger(tmp_path, WandbConfig(mode="disabled"), {})
    logger._wandb = fake = _RecordingWandb()
    logger.log({"step": 5, "loss": 1.25, "lr": 1e-3})
    logger.log_images({"loss": png, "expert_load": tmp_path / "missing.png"}, step=5)
    # What wandb keeps at step 5 per key: the last value logged under it.
    final = {}
    for step, values in fake.calls:
        assert step == 5
        final.update(values)
    assert final["loss"] == 1.25 and final["plots/loss"] == ("image", str(png))
    assert "plots/expert_load" not in final


@pytest.mark.slow
def test_process_exits_promptly_after_a_signal_save_despite_queued_compiles(tmp_path):
    proc = subprocess.Popen([sys.executable, "tests/trainer/exit_worker.py", "train", "--config",
                             "configs/k3_tiny.yaml", *SMALL, "--run-dir", str(tmp_path), "train.steps=100000",
                             "train.log_interval=1"], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert _wait_for(lambda: (tmp_path / "metrics.jsonl").exists())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)  # the queued "compiles" alone would hold it 300 s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the process did not exit within 90 s of its SIGTERM")
    assert proc.returncode == 0, out
    assert "signal received: saved step" in out
    assert "without waiting for thread queued-compile_0" in out


@pytest.mark.slow
def test_inductor_compile_workers_are_killed_not_awaited():
    from torch._inductor import async_compile

    from k3train.runtime.process_exit import stop_inductor_compile_workers

    pool = async_compile.AsyncCompile.process_pool()  # what torch.compile starts on CUDA
    if not hasattr(pool, "process"):
        pytest.skip(f"this torch's Inductor pool is a {type(pool).__name__}, not a SubprocPool")
    job = pool.submit(time.sleep, 600)  # a compile that outlives the run
    t0 = time.time()
    assert stop_inductor_compile_workers() == 1
    assert pool.process.poll() is not None and time.time() - t0 < 10
    assert len(async_compile._pool_set) == 0, "Inductor's atexit handler must find no pool"
    assert job.done()


def test_repeats_of_one_stop_signal_count_once():

    with _SignalGuard() as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the copy torchrun or SLURM also delivered
        assert guard.requested
        guard._first -= guard.REPEAT_S  # a signal REPEAT_S later is a second request: abort
        with pytest.raises(KeyboardInterrupt, match="second signal"):
            os.kill(os.getpid(), signal.SIGTERM)
