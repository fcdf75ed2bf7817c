"""What the commands hand to the library: --overwrite reaches export_mxfp4, export_hf_checkpoint
and import_hf (False unless given); train prepares the CUDA environment once."""
from pathlib import Path

import pytest

import k3train.runtime.cuda_env as cuda_env
import k3train.trainer.export as export
import k3train.trainer.hf_import as hf_import
import k3train.trainer.loop as loop
from k3train.cli import main
from k3train.errors import UsageError


class _Stop(UsageError):
    pass


@pytest.mark.parametrize("argv, module, name", [
    (["export-mxfp4", "--checkpoint", "c", "--out", "o"], export, "export_mxfp4"),
    (["export-hf", "--checkpoint", "c", "--out", "o"], export, "export_hf_checkpoint"),
    (["import", "h", "--out", "o"], hf_import, "import_hf"),
])
def test_overwrite_reaches_the_library(monkeypatch, argv, module, name):
    seen = []

    def fake(*args, overwrite, **kwargs):
        seen.append(overwrite)
        raise _Stop("stopped before writing")

    monkeypatch.setattr(module, name, fake)
    assert main(argv) == 2
    assert main([*argv, "--overwrite"]) == 2
    assert seen == [False, True]


def test_train_prepares_the_cuda_environment_once(monkeypatch, tmp_path):
    calls = []

    def count(cfg):
        calls.append(cfg.train.steps)

    def stop(self):
        raise _Stop("stopped after set-up began")

    monkeypatch.setattr(cuda_env, "prepare_cuda_env", count)
    monkeypatch.setattr(loop, "prepare_cuda_env", count)
    monkeypatch.setattr(loop.Trainer, "run_loop", stop)
    monkeypatch.setattr(loop.Trainer, "set_up", lambda self: (loop.prepare_cuda_env(self.cfg), stop(self)))
    rc = main(["train", "--config", "configs/k3_tiny.yaml", "--run-dir", str(tmp_path / "run"), "train.steps=3"])
    assert rc == 2 and calls == [3]
    assert not Path(tmp_path / "run" / "metrics.jsonl").exists()
