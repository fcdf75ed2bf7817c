"""The `latest` pointer is only ever a step name of the run's own checkpoints/; a bad pointer,
or one naming a corrupt step, falls back to the newest step that verifies and says so; a
`latest` directory and a resume past train.steps are refused in one line, changing nothing."""
import os
import shutil

import pytest

from k3train.errors import CheckpointError, RunDirError
from k3train.trainer import checkpoint
from k3train.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from k3train.trainer.loop import train
from tests.helpers import read_records, small_cfg

STEPS = ["train.log_interval=1", "train.eval_interval=100", "checkpoint.interval=1", "checkpoint.keep_last=5"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step run with a checkpoint at every step."""
    run_dir = tmp_path_factory.mktemp("ptr") / "run"
    train(small_cfg("train.steps=3", *STEPS), run_dir)
    return run_dir


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _listing(root):
    """Every file with its size and mtime, but run.lock (the run's own lock, taken by every attempt)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.name != "run.lock"}


@pytest.mark.parametrize("content", [b"", b"..", b"/etc", b"step_00000002/../../x", b"\xff\xfe"],
                         ids=["empty", "dotdot", "absolute", "escaping", "not-text"])
def test_a_bad_pointer_is_never_followed(run, tmp_path, content):
    ckpt = _copy(run, tmp_path) / "checkpoints"
    (ckpt / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match="latest"):
        latest_checkpoint(ckpt)


def test_resume_falls_back_from_a_bad_or_corrupt_latest_and_says_so(run, tmp_path, capsys):
    for damage in ("pointer", "corrupt"):
        run_dir = _copy(run, tmp_path / damage)
        ckpt = run_dir / "checkpoints"
        if damage == "pointer":
            (ckpt / "latest").write_text("..")
        else:  # flip a byte of the newest step's rank file: its checksum fails
            rank_file = next(p for p in (ckpt / "step_00000003").iterdir() if p.name != "manifest.json")
            data = bytearray(rank_file.read_bytes())
            data[len(data) // 2] ^= 0xFF
            rank_file.write_bytes(bytes(data))
        summary = train(small_cfg("train.steps=4", *STEPS), run_dir, resume=True)
        out = capsys.readouterr().out
        want = "step_00000003" if damage == "pointer" else "step_00000002"
        assert f"resuming from {want}, the newest checkpoint that verifies" in out, out
        assert summary["steps"] == 4 and read_records(run_dir)[-1]["step"] == 4


def test_a_latest_directory_and_a_resume_past_the_steps_are_refused_unchanged(run, tmp_path):
    run_dir = _copy(run, tmp_path)
    before = _listing(run_dir)
    with pytest.raises(RunDirError, match=r"step_00000003 is step 3, past train.steps=2"):
        train(small_cfg("train.steps=2", *STEPS), run_dir, resume=True)
    assert _listing(run_dir) == before  # config.yaml and every checkpoint untouched
    os.remove(run_dir / "checkpoints" / "latest")
    (run_dir / "checkpoints" / "latest").mkdir()
    before = _listing(run_dir)
    with pytest.raises(CheckpointError, match="is a directory"):
        train(small_cfg("train.steps=5", *STEPS), run_dir, resume=True)
    assert _listing(run_dir) == before


def test_a_step_symlinked_to_another_run_is_never_followed(run, tmp_path):
    """`latest` names a well-formed step, but that step is a link into another run's checkpoints/."""
    run_dir, other = _copy(run, tmp_path / "a"), _copy(run, tmp_path / "b")
    ckpt = run_dir / "checkpoints"
    (ckpt / "step_00000009").symlink_to(other / "checkpoints" / "step_00000003")
    (ckpt / "latest").write_text("step_00000009")
    with pytest.raises(CheckpointError, match="leads out of"):
        latest_checkpoint(ckpt)


def test_resume_hashes_each_rank_file_once_and_a_changed_file_again(run, tmp_path, monkeypatch):
    """The plan and the load both verify `latest`: the second pass reuses the first's sha256
    unless the file changed since (its ctime moves with any write)."""
    run_dir = _copy(run, tmp_path)
    hashed = []
    real = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda path: hashed.append(path.parent.name) or real(path))
    train(small_cfg("train.steps=4", *STEPS), run_dir, resume=True)
    # step 3's one rank file read once for plan + load; step 4's when its save writes the manifest
    assert hashed == ["step_00000003", ".tmp-step_00000004"], hashed
    step = run_dir / "checkpoints" / "step_00000004"
    verify_checkpoint(step, 1)
    rank_file = step / "rank_00000.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(data))  # same size, new content
    with pytest.raises(CheckpointError, match="corrupted"):
        verify_checkpoint(step, 1)
