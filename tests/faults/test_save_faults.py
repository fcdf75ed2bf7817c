"""ISSUE44 item 9 (CPU part): a save checks the free space against the checkpoint's tensor bytes
first; a full disk in the middle of torch.save's zip writer (which torch reports as
``RuntimeError: unexpected pos``), an I/O error while publishing, or an interrupt leave no
partial file and keep the previous checkpoint; every refusal is one line naming the path and
the free space. ``train.async_save``: the background save's files equal a synchronous save's,
bit for bit, and a second save waits for the first."""
import errno
import io
import shutil
import threading
import time
from collections import namedtuple

import pytest
import torch

from k3train.errors import CheckpointError
from k3train.trainer import checkpoint as ckpt_mod
from k3train.trainer.async_save import CheckpointWriter
from k3train.trainer.checkpoint import latest_checkpoint, save_checkpoint, verify_checkpoint
from k3train.trainer.loop import train
from tests.multiproc import run_multiprocess
from tests.helpers import small_cfg

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


# --- train.async_save: the snapshot written in the background --------------------------------


def _files(step_dir):
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir())}


@pytest.mark.slow  # trains a tiny model twice, 4 steps each
def test_async_saves_equal_synchronous_saves_bit_for_bit(tmp_path, monkeypatch):
    """The async run keeps training while its step-2 checkpoint is written; the files must still
    be the step-2 state: equal, byte for byte, to the synchronous run's (and step 4's too). Each
    write starts late (0.8 s), after the next step has updated the weights in place: a file
    aliasing the live weights would hold step 3's."""
    real_save = torch.save

    def late_save(obj, f, *args, **kwargs):
        time.sleep(0.8)
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", late_save)
    runs = {}
    for mode in ("false", "true"):
        runs[mode] = tmp_path / f"async_{mode}"
        torch.manual_seed(0)  # the saved RNG state is the process's: start both runs from the same
        train(small_cfg("train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=5", "train.log_interval=1",
                   f"train.async_save={mode}"), runs[mode])
    for step in ("step_00000002", "step_00000004"):
        sync, background = (_files(runs[m] / "checkpoints" / step) for m in ("false", "true"))
        assert sorted(sync) == ["manifest.json", "rank_00000.pt"]
        assert sync == background, step
    assert latest_checkpoint(runs["true"] / "checkpoints").name == "step_00000004"


def test_a_second_async_save_waits_for_the_first(tmp_path, monkeypatch):
    real_save, events, lock = torch.save, [], threading.Lock()

    def slow_save(obj, f, *args, **kwargs):
        with lock:
            events.append(("write-start", obj["step"], time.monotonic()))
        time.sleep(0.3)
        real_save(obj, f, *args, **kwargs)
        with lock:
            events.append(("write-end", obj["step"], time.monotonic()))
    monkeypatch.setattr(torch, "save", slow_save)

    def build(step):
        def make():
            with lock:
                events.append(("snapshot", step, time.monotonic()))
            return _state(step), None
        return make

    writer = CheckpointWriter(asynchronous=True)
    ckpt = tmp_path / "checkpoints"
    t0 = time.monotonic()
    writer.save(ckpt, 2, build(2), layout=LAYOUT)
    returned = time.monotonic() - t0
    assert writer.in_flight and returned < 0.25  # the caller went on while the file was written
    writer.save(ckpt, 4, build(4), layout=LAYOUT)
    assert writer.wait().name == "step_00000004"
    kinds = [(kind, step) for kind, step, _ in events]
    # the second snapshot is taken only after the first save has written its file (one in flight)
    assert kinds == [("snapshot", 2), ("write-start", 2), ("write-end", 2),
                     ("snapshot", 4), ("write-start", 4), ("write-end", 4)]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert verify_checkpoint(latest_checkpoint(ckpt), world_size=1)["step"] == 4


def test_an_async_save_s_failure_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    ckpt = _saved_once(tmp_path)
    listing = _listing(ckpt)
    writer = CheckpointWriter(asynchronous=True)
    monkeypatch.setattr(ckpt_mod, "open", _open_failing(1000, OSError(errno.ENOSPC, "No space left on device")),
                        raising=False)
    writer.save(ckpt, 4, lambda: (_state(4), None), layout=LAYOUT)
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt: No space left on device.*step_00000002\) is intact"):
        writer.wait()
    _intact(ckpt, listing)
    assert writer.wait() is None  # the error is raised once


def _async_two_ranks(rank, world, root):
    import torch.distributed as dist

    writer = CheckpointWriter(asynchronous=True)
    state = {"step": 2, "model": {"w": torch.full((64, 64), float(rank))}}
    writer.save(root / "async", 2, lambda: (state, None), layout=LAYOUT, coords={"pp": 0, "tp": 0, "ep": 0, "dp": rank})
    # the training thread's collectives go on over the world group while the save exchanges
    # its outcomes over its own group
    total = torch.zeros(1)
    for _ in range(50):
        x = torch.ones(1)
        dist.all_reduce(x)
        total += x
    assert total.item() == 50 * world
    writer.wait()
    save_checkpoint(root / "sync", 2, state, layout=LAYOUT, coords={"pp": 0, "tp": 0, "ep": 0, "dp": rank})


@pytest.mark.slow  # two gloo processes
def test_an_async_save_on_two_ranks_commits_once_both_files_are_complete(tmp_path):
    run_multiprocess(_async_two_ranks, 2, tmp_path)
    a, s = tmp_path / "async" / "step_00000002", tmp_path / "sync" / "step_00000002"
    assert sorted(_files(a)) == ["manifest.json", "rank_00000.pt", "rank_00001.pt"]
    assert _files(a) == _files(s)
    verify_checkpoint(a, world_size=2)
