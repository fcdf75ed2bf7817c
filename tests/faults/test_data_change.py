"""Issue 44 item 6 (resume part): a checkpoint's manifest records the content hash of the data
it was trained on; ``--resume`` onto a dataset re-prepared at the same prefix (or another
``data.source``) is refused in one line naming ``train.allow_data_change`` and changes nothing
on disk; with the flag it warns and continues."""
import json
import os

import pytest

from k3train.cli import main as cli_main
from k3train.data import ByteTokenizer, prepare_data
from k3train.data.dataset import dataset_content_hash
from k3train.errors import CheckpointError
from k3train.trainer.checkpoint import latest_checkpoint
from k3train.trainer.loop import train
from tests.helpers import read_records, small_cfg

pytestmark = pytest.mark.slow  # trains a tiny model three times, 2 steps each

STEPS = ["train.log_interval=1", "train.eval_interval=100", "checkpoint.interval=1"]


def _listing(root):
    """Every file but run.lock (each attempt takes it) -> (size, mtime_ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.name != "run.lock"}


def _prepare(tmp_path, name, text, overwrite=False):
    (tmp_path / f"{name}.txt").write_text(text)
    prepare_data([tmp_path / f"{name}.txt"], tmp_path / "ds", ByteTokenizer(), txt_split="lines",
                 overwrite=overwrite)
    return str(tmp_path / "ds")


def test_resume_onto_re_prepared_data_is_refused_unless_allowed(tmp_path, capsys):
    lines_a = "".join(f"the cat sat on mat number {i}.\n" for i in range(60))
    prefix = _prepare(tmp_path, "a", lines_a)
    first = dataset_content_hash(prefix)
    run = tmp_path / "run"
    train(small_cfg("train.steps=2", f"data.source={prefix}", *STEPS), run)
    manifest = json.loads((latest_checkpoint(run / "checkpoints") / "manifest.json").read_text())
    assert manifest["data"]["content_sha256"] == [first]

    # Re-prepared at the same prefix: same path, other content.
    _prepare(tmp_path, "b", "".join(f"a dog ran to park number {i}.\n" for i in range(80)), overwrite=True)
    assert dataset_content_hash(prefix) not in (None, first)
    before = _listing(run)
    cfg = small_cfg("train.steps=4", f"data.source={prefix}", *STEPS)
    with pytest.raises(CheckpointError, match=r"trained on other data: dataset content sha256 "
                                              rf"\[{first[:12]}\] in the checkpoint.*train\.allow_data_change=true"):
        train(cfg, run, resume=True)
    assert _listing(run) == before  # config.yaml, metrics and checkpoints untouched

    # Through the CLI: one line, exit 2.
    capsys.readouterr()
    rc = cli_main(["train", "--config", str(run / "config.yaml"), "--run-dir", str(run), "--resume",
                   "train.steps=4"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("k3train: error: --resume:") and "\n" not in err, err
    assert "train.allow_data_change" in err
    assert _listing(run) == before

    # Accepted with the flag: a warning, and training continues from step 2 on the new data.
    summary = train(small_cfg("train.steps=4", f"data.source={prefix}", "train.allow_data_change=true", *STEPS),
                    run, resume=True)
    out = capsys.readouterr().out
    assert "WARNING: train.allow_data_change" in out and first[:12] in out, out
    assert summary["steps"] == 4 and [r["step"] for r in read_records(run)] == [1, 2, 3, 4]
    manifest = json.loads((latest_checkpoint(run / "checkpoints") / "manifest.json").read_text())
    assert manifest["data"]["content_sha256"] == [dataset_content_hash(prefix)]


def test_a_moved_dataset_is_the_same_data(tmp_path, capsys):
    """The hash names the data, not its path: a dataset copied elsewhere resumes without a word."""
    prefix = _prepare(tmp_path, "a", "".join(f"the cat sat on mat number {i}.\n" for i in range(60)))
    run = tmp_path / "run"
    train(small_cfg("train.steps=2", f"data.source={prefix}", *STEPS), run)
    moved = tmp_path / "moved"
    moved.mkdir()
    for suffix in (".bin", ".idx", ".meta.json"):
        os.rename(prefix + suffix, moved / f"ds{suffix}")
    capsys.readouterr()
    summary = train(small_cfg("train.steps=3", f"data.source={moved / 'ds'}", *STEPS), run, resume=True)
    assert summary["steps"] == 3 and "WARNING" not in capsys.readouterr().out
