"""The offline wandb run starts on a thread of its own (k3train/trainer/metrics.py): the logger
is ready before ``wandb.init`` returns, waits for it at its first use, and raises its error there."""
from __future__ import annotations

import sys
import threading
import types

import pytest

from k3train.config.schema import WandbConfig
from k3train.trainer.metrics import MetricsLogger


class _FakeRun:
    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


def _fake_wandb(monkeypatch, init):
    module = types.ModuleType("wandb")
    module.init, module.Settings = init, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)


def test_offline_start_does_not_block_and_the_first_log_waits(tmp_path, monkeypatch):
    release, run, calls = threading.Event(), _FakeRun(), []

    def init(**kwargs):
        calls.append((threading.current_thread() is threading.main_thread(), kwargs["mode"]))
        assert release.wait(30)
        return run

    _fake_wandb(monkeypatch, init)
    logger = MetricsLogger(tmp_path, WandbConfig(mode="offline"), {"a": 1})
    assert not run.logged  # constructed while init is still blocked
    release.set()
    logger.log({"step": 1, "loss": 2.5})
    assert calls == [(False, "offline")]
    assert run.logged == [(1, {"loss": 2.5})]
    logger.close()
    assert run.finished and (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_an_offline_start_error_is_raised_at_first_use(tmp_path, monkeypatch):
    def init(**kwargs):
        raise RuntimeError("wandb could not start")

    _fake_wandb(monkeypatch, init)
    logger = MetricsLogger(tmp_path, WandbConfig(mode="offline"), {})
    with pytest.raises(RuntimeError, match="wandb could not start"):
        logger.log({"step": 1, "loss": 1.0})


def test_online_start_runs_before_the_logger_returns(tmp_path, monkeypatch):
    calls = []
    _fake_wandb(monkeypatch, lambda **kw: calls.append(threading.current_thread() is threading.main_thread())
                or _FakeRun())
    MetricsLogger(tmp_path, WandbConfig(mode="online"), {})
    assert calls == [True]  # on this thread: an online start may ask for a login
