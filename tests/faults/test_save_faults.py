"""ISSUE44 item 9 (CPU part): a save checks the free space against the checkpoint's tensor bytes
first; a full disk in the middle of torch.save's zip writer (which torch reports as
``RuntimeError: unexpected pos``), an I/O error while publishing, or an interrupt leave no
partial file and keep the previous checkpoint; every refusal is one line naming the path and
the free space."""
import errno
import io
import shutil
from collections import namedtuple

import pytest
import torch

from k3train.errors import CheckpointError
from k3train.trainer import checkpoint as ckpt_mod
from k3train.trainer.checkpoint import latest_checkpoint, save_checkpoint, verify_checkpoint

LAYOUT = {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "dp": 1, "zero1": False}
Usage = namedtuple("Usage", "total used free")


def _state(step):
    """2000 fp32 values + 16 int64 = 8128 tensor bytes (the reference for the needed bytes)."""
    return {"step": step, "model": {"w": torch.full((20, 100), float(step))}, "opt": [torch.arange(16)]}


NEEDED = 20 * 100 * 4 + 16 * 8


def _saved_once(tmp_path):
    ckpt = tmp_path / "checkpoints"
    save_checkpoint(ckpt, 2, _state(2), layout=LAYOUT)
    return ckpt


def _listing(ckpt):
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))


def _intact(ckpt, listing):
    assert _listing(ckpt) == listing
    assert verify_checkpoint(latest_checkpoint(ckpt), world_size=1)["step"] == 2


def test_a_save_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    ckpt = _saved_once(tmp_path)
    listing = _listing(ckpt)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - NEEDED + 1, NEEDED - 1))
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT)
    msg = str(info.value)
    assert "\n" not in msg and str(ckpt) in msg
    assert f"has {NEEDED - 1:,} bytes free" in msg and f"needs about {NEEDED:,} bytes" in msg
    assert "previous checkpoint (step_00000002) is intact" in msg
    _intact(ckpt, listing)
    # exactly enough is enough
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - NEEDED, NEEDED))
    assert save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT).name == "step_00000004"


class _FullDisk(io.FileIO):
    """A file whose writes fail once ``limit`` bytes are written, as on a full disk; ``exc``
    is what the failing write raises."""

    def __init__(self, *args, limit, exc, **kwargs):
        super().__init__(*args, **kwargs)
        self.written, self.limit, self.exc = 0, limit, exc

    def write(self, data):
        self.written += len(data)
        if self.written > self.limit:
            raise self.exc
        return super().write(data)


def _open_failing(limit, exc):
    def fake_open(path, mode="r", *args, **kwargs):
        if str(path).endswith(".pt") and "w" in mode:
            return _FullDisk(path, "wb", limit=limit, exc=exc)
        return open(path, mode, *args, **kwargs)
    return fake_open


def test_a_full_disk_inside_torch_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = _saved_once(tmp_path)
    listing = _listing(ckpt)
    # After 1000 bytes torch's zip writer has started its records: torch raises its own
    # "unexpected pos" RuntimeError while handling the OSError (a traceback before).
    monkeypatch.setattr(ckpt_mod, "open", _open_failing(1000, OSError(errno.ENOSPC, "No space left on device")),
                        raising=False)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 123_456, 123_456))
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT)
    msg = str(info.value)
    assert "\n" not in msg and "No space left on device" in msg
    assert ".tmp-step_00000004/rank_00000.pt" in msg and "123,456 bytes free there" in msg
    assert "previous checkpoint (step_00000002) is intact" in msg
    _intact(ckpt, listing)


def test_an_interrupted_write_leaves_no_partial_files(tmp_path, monkeypatch):
    ckpt = _saved_once(tmp_path)
    listing = _listing(ckpt)
    monkeypatch.setattr(ckpt_mod, "open", _open_failing(1000, KeyboardInterrupt()), raising=False)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT)
    _intact(ckpt, listing)


def test_an_io_error_while_publishing_is_one_line_with_the_free_space(tmp_path, monkeypatch):
    ckpt = _saved_once(tmp_path)
    listing = _listing(ckpt)

    def manifest_fails(path, text, **kwargs):
        raise OSError(errno.EIO, "Input/output error", str(path))
    monkeypatch.setattr(ckpt_mod, "write_text_atomic", manifest_fails)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**10, 10**9, 7_777_777))
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT)
    msg = str(info.value)
    assert "\n" not in msg and ".tmp-step_00000004/manifest.json: Input/output error" in msg
    assert "7,777,777 bytes free there" in msg
    _intact(ckpt, listing)


def test_a_killed_save_s_temporary_directory_is_removed_by_the_next_save(tmp_path):
    ckpt = _saved_once(tmp_path)
    stale = ckpt / ".tmp-step_00000003"
    stale.mkdir()
    (stale / "rank_00000.pt").write_bytes(b"half a file")
    save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004"]
