"""Export (both formats) and import never delete what they did not write: a run directory or
a user's folder given as ``--out`` is refused in one line with nothing changed on disk; their
own previous output is replaced only with ``overwrite=True`` (k3train.runtime.files.output_dir)."""
import os

import pytest

from k3train.config import load_config
from k3train.trainer.run_dir import save_config
from k3train.errors import K3TrainError
from k3train.hf.export import export_hf
from k3train.model.model import build_model
from k3train.runtime.files import OUTPUT_MANIFEST, default_file_mode, output_dir
from k3train.trainer.checkpoint import save_checkpoint
from k3train.trainer.export import export_hf_checkpoint, export_mxfp4
from k3train.trainer.hf_import import import_hf
from tests.helpers import small_cfg


def _listing(root):
    """Every path under ``root`` with its bytes (directories as None)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def run(tmp_path, world1):
    """A run directory as training leaves it: config.yaml, metrics.jsonl, a checkpoint."""
    cfg = small_cfg()
    run = tmp_path / "run"
    save_config(cfg, run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    save_checkpoint(run / "checkpoints", 1, {"step": 1, "model": build_model(cfg).state_dict()},
                    layout={"world_size": 1}, coords={"pp": 0, "tp": 0, "ep": 0, "dp": 0})
    return run


def _exports(run):
    """Each directory writer, as a function of (out, overwrite)."""
    return {
        "export-mxfp4": lambda out, ow: export_mxfp4(run / "checkpoints", out, overwrite=ow),
        "export-hf": lambda out, ow: export_hf_checkpoint(run, out, overwrite=ow, log=lambda *_: None),
    }


def _one_line_refusal(fn, *words):
    with pytest.raises(K3TrainError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_export_over_a_run_or_a_users_folder_refuses_and_changes_nothing(tmp_path, run):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("do not lose me")
    before = _listing(tmp_path)
    for name, export in _exports(run).items():
        for overwrite in (False, True):
            _one_line_refusal(lambda: export(run, overwrite), str(run), "training run")
            _one_line_refusal(lambda: export(user, overwrite), str(user), "non-empty directory")
    assert _listing(tmp_path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary sibling left


def test_reexport_needs_overwrite_and_then_replaces_its_own_output(tmp_path, run):
    for name, export in _exports(run).items():
        out = tmp_path / f"out-{name}"
        export(out, False)
        assert (out / OUTPUT_MANIFEST).is_file()
        (out / "stale.bin").write_text("from an earlier export")
        before = _listing(out)
        _one_line_refusal(lambda: export(out, False), "--overwrite")
        assert _listing(out) == before
        export(out, True)
        assert not (out / "stale.bin").exists() and (out / OUTPUT_MANIFEST).is_file()
    # one format's output is not the other's to replace
    _one_line_refusal(lambda: _exports(run)["export-hf"](tmp_path / "out-export-mxfp4", True), "export-mxfp4")


def test_import_refuses_a_run_and_replaces_only_its_own_import(tmp_path, run):
    cfg = load_config(run / "config.yaml")
    hf = tmp_path / "hf"
    export_hf(build_model(cfg).state_dict(), cfg, hf, log=lambda *_: None)
    before = _listing(run)
    _one_line_refusal(lambda: import_hf(hf, run, overwrite=True), str(run), "training run")
    assert _listing(run) == before
    out = tmp_path / "imported"
    step = import_hf(hf, out)
    assert step == out / "checkpoints" / "step_00000000" and (step / "manifest.json").is_file()
    _one_line_refusal(lambda: import_hf(hf, out), "--overwrite")
    import_hf(hf, out, overwrite=True)
    # once a run has trained in it, it is a run: never replaced
    (out / "metrics.jsonl").write_text("{}\n")
    _one_line_refusal(lambda: import_hf(hf, out, overwrite=True), "training run")


def test_written_files_are_readable_like_any_file_not_0600(tmp_path, run):
    """safetensors and mkstemp create 0600 files; the exports and config.yaml get the umask's mode."""
    mx = _exports(run)["export-mxfp4"](tmp_path / "mx", False)
    save_config(load_config(run / "config.yaml"), tmp_path / "c" / "config.yaml")
    for f in (mx / "model.safetensors", mx / OUTPUT_MANIFEST, tmp_path / "c" / "config.yaml"):
        assert f.stat().st_mode & 0o777 == default_file_mode(), f


def test_a_failed_write_leaves_the_previous_output(tmp_path):
    out = tmp_path / "out"
    with output_dir(out, command="demo") as tmp:
        (tmp / "a.txt").write_text("first")
    with pytest.raises(RuntimeError):
        with output_dir(out, command="demo", overwrite=True) as tmp:
            (tmp / "a.txt").write_text("second, unfinished")
            raise RuntimeError("disk on fire")
    assert (out / "a.txt").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["out"]
