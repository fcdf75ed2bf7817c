"""Issue 44 item 1's last piece: export reads a live run's checkpoint without its lock (a step is
committed by an atomic rename and never changed after); the one thing the run does to it,
pruning, stops the export in one line naming the file, with nothing written."""
import shutil

import pytest
import torch

from k3train.cli import main as cli_main
from k3train.trainer.loop import train
from k3train.trainer.run_lock import RunDirLock
from tests.helpers import small_cfg


@pytest.mark.slow  # trains a tiny model for 1 step
def test_export_of_a_locked_run_works_and_a_step_pruned_under_it_is_one_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    train(small_cfg("train.steps=1", "train.eval_interval=100"), run)
    with RunDirLock(run):  # as if the run were still training: export does not need its lock
        assert cli_main(["export-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()

        # The run prunes the step after export verified it and before it opened the rank file.
        real_load = torch.load

        def pruned_then_load(path, *args, **kwargs):
            shutil.rmtree(run / "checkpoints" / "step_00000001", ignore_errors=True)
            return real_load(path, *args, **kwargs)

        monkeypatch.setattr(torch, "load", pruned_then_load)
        capsys.readouterr()
        rc = cli_main(["export-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf2")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("k3train: error: ") and "\n" not in err, err
    assert "rank_00000.pt vanished while it was read" in err and "checkpoint.keep_last" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no hf2, no temporary sibling
