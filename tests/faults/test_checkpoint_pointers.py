"""ISSUE44 item 8: ``checkpoints/latest`` is validated as a step name of the run's own
``checkpoints/``; a malformed pointer, or one naming a missing or corrupt step, falls back to the
newest step that verifies and says so in one line; a ``latest`` that is a directory is refused
in one line; ``--resume`` with ``train.steps`` below the checkpoint's step is refused and changes
nothing on disk."""
import re

import pytest
import torch

from k3train.errors import CheckpointError, UsageError
from k3train.trainer.checkpoint import latest_checkpoint, save_checkpoint
from k3train.trainer.loop import train
from k3train.trainer.restore import resolve_checkpoint
from k3train.trainer.run_dir import plan_run_dir
from tests.trainer.test_train import _cfg

LAYOUT = {"world_size": 1, "rank": 0, "local_rank": 0, "tp": 1, "pp": 1, "vpp": 1, "ep": 1, "dp": 1, "zero1": False}


def _run(root, steps=(2, 4, 6)):
    """A run directory with one-rank checkpoints of ``steps`` (``latest`` names the last)."""
    run = root / "run"
    for step in steps:
        save_checkpoint(run / "checkpoints", step, {"w": torch.full((8,), float(step))}, layout=LAYOUT, keep_last=5)
    return run


def _snapshot(path):
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def _plan(run):
    lines = []
    path = plan_run_dir(run, resume=True, overwrite=False, world_size=1, layout=LAYOUT, log=lines.append)
    return path, lines


@pytest.mark.parametrize("content, why", [
    (b"", r"holds nothing, not a step directory name"),
    (b"..", r"holds '\.\.', not a step directory name"),
    (b"step_00000006/..", r"not a step directory name"),
    (b"\xff\xfe\x00bad", r"is not UTF-8 text"),
    (b"step_00000009", r"names step_00000009, which does not exist"),
])
def test_a_malformed_or_dangling_latest_falls_back_to_the_newest_verifying_step(tmp_path, content, why):
    run = _run(tmp_path)
    (run / "checkpoints" / "latest").write_bytes(content)
    path, lines = _plan(run)
    assert path == run / "checkpoints" / "step_00000006"
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("[k3train] --resume: ") and "resuming from step_00000006" in lines[0]
    assert re.search(why, lines[0]), lines[0]


def test_an_absolute_latest_into_another_run_is_not_followed(tmp_path):
    run = _run(tmp_path)
    other = _run(tmp_path / "elsewhere", steps=(100,))
    (run / "checkpoints" / "latest").write_text(str(other / "checkpoints" / "step_00000100"))
    path, lines = _plan(run)
    assert path == run / "checkpoints" / "step_00000006"
    assert "not a step directory name" in lines[0]
    # eval/generate/export: one line, the other run is not opened
    with pytest.raises(CheckpointError, match=r"not a step directory name"):
        resolve_checkpoint(run)


def test_a_symlinked_step_of_another_run_is_not_followed(tmp_path):
    run = _run(tmp_path, steps=(2,))
    other = _run(tmp_path / "elsewhere", steps=(100,))
    (run / "checkpoints" / "step_00000100").symlink_to(other / "checkpoints" / "step_00000100")
    (run / "checkpoints" / "latest").write_text("step_00000100")
    with pytest.raises(CheckpointError, match=r"leads out of"):
        latest_checkpoint(run / "checkpoints")


def test_latest_naming_a_corrupt_step_falls_back(tmp_path):
    run = _run(tmp_path)
    rank_file = run / "checkpoints" / "step_00000006" / "rank_00000.pt"
    data = bytearray(rank_file.read_bytes())
    data[-40] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    path, lines = _plan(run)
    assert path == run / "checkpoints" / "step_00000004"
    assert len(lines) == 1 and "names step_00000006, which does not verify" in lines[0]
    assert "corrupted" in lines[0] and "resuming from step_00000004" in lines[0]


def test_latest_that_is_a_directory_is_refused_in_one_line(tmp_path):
    run = _run(tmp_path)
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").mkdir()
    before = _snapshot(run)
    with pytest.raises(CheckpointError) as info:
        _plan(run)
    msg = str(info.value)
    assert "\n" not in msg and "latest is a directory, not the pointer file" in msg
    with pytest.raises(CheckpointError, match=r"latest is a directory"):
        resolve_checkpoint(run)
    assert _snapshot(run) == before


@pytest.mark.slow  # trains a tiny model twice (about 20-40 s on two shared cores)
def test_resume_from_a_corrupt_latest_trains_on_and_fewer_steps_are_refused(tmp_path, capsys):
    train(_cfg("train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=3", "train.log_interval=1"), tmp_path)
    ckpt = tmp_path / "checkpoints"
    (ckpt / "latest").write_text("..")
    train(_cfg("train.steps=6", "checkpoint.interval=2", "checkpoint.keep_last=3", "train.log_interval=1"),
          tmp_path, resume=True)
    out = capsys.readouterr().out
    assert "resuming from step_00000004" in out and "resumed from" in out and "(step 4)" in out
    assert latest_checkpoint(ckpt).name == "step_00000006"
    # train.steps=3 is below the checkpoint's step 6: refused, nothing on disk changes
    before = _snapshot(tmp_path)
    with pytest.raises(UsageError) as info:
        train(_cfg("train.steps=3"), tmp_path, resume=True)
    msg = str(info.value)
    assert "\n" not in msg and "at step 6, past train.steps=3" in msg
    assert _snapshot(tmp_path) == before
