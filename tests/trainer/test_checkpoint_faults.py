"""Checkpoint faults: a full disk during a save, malformed manifests."""
import errno
import json

import pytest
import torch

from k3train.errors import CheckpointError
from k3train.trainer.checkpoint import latest_checkpoint, save_checkpoint, verify_checkpoint
from tests.multiproc import run_multiprocess

LAYOUT = {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "dp": 1, "zero1": False}


def _state(step):
    """A small state: 1000 fp32 + 24 int64 values = 4192 tensor bytes."""
    return {"step": step, "model": {"w": torch.full((10, 100), float(step))}, "opt": [torch.arange(24)]}


def _full_disk(real_save, fail_rank=None):
    """torch.save that writes part of the file, then fails as a full disk does."""
    def save(obj, f, *args, **kwargs):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        if fail_rank is None or rank == fail_rank:
            f.write(b"partial" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)
    return save


def test_full_disk_during_a_save_cleans_up_and_names_path_and_bytes(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    save_checkpoint(ckpt, 2, _state(2), layout=LAYOUT)
    monkeypatch.setattr(torch, "save", _full_disk(torch.save))
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT)
    msg = str(info.value)
    assert "\n" not in msg and "No space left on device" in msg
    assert ".tmp-step_00000004/rank_00000.pt" in msg
    assert f"needs about {10 * 100 * 4 + 24 * 8:,} bytes per rank" in msg  # the tensors' nbytes
    assert "previous checkpoint (step_00000002) is intact" in msg
    # The partial file and its temporary directory are gone; the previous checkpoint verifies.
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002"]
    assert verify_checkpoint(latest_checkpoint(ckpt), world_size=1)["step"] == 2


def _one_rank_disk_full(rank, world, root):
    import torch as t

    ckpt = root / "checkpoints"
    save_checkpoint(ckpt, 2, _state(2), layout=LAYOUT)
    t.save = _full_disk(t.save, fail_rank=1)
    # Every rank must get the refusal (before: rank 0 waited in the save's barrier for ever).
    with pytest.raises(CheckpointError, match=r"rank_00001\.pt: No space left on device"):
        save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT)
    if rank == 0:
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002"]


@pytest.mark.slow
def test_full_disk_on_one_rank_refuses_on_every_rank(tmp_path):
    run_multiprocess(_one_rank_disk_full, 2, tmp_path)


def _edit_manifest(path, edit):
    manifest_file = path / "manifest.json"
    data = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps(edit(data)))


@pytest.mark.parametrize("edit, message", [
    (lambda m: {**m, "files": {}}, r"files lists nothing, expected one per rank: rank_00000\.pt"),
    (lambda m: {**m, "step": 6}, r"it records step 6, but its directory is step_00000004"),
    (lambda m: {k: v for k, v in m.items() if k != "layout"}, r"missing layout"),
    (lambda m: {**m, "files": ["rank_00000.pt"]}, r"files lists \['rank_00000\.pt'\], expected"),
    (lambda m: {**m, "files": {"rank_00000.pt": "abc"}}, r"entry rank_00000\.pt needs a sha256"),
    (lambda m: [m], r"expected a JSON object, got list"),
], ids=["no-files", "step-mismatch", "missing-key", "files-not-object", "entry-not-object", "not-object"])
def test_malformed_manifest_is_refused_in_one_line(tmp_path, edit, message):
    ckpt = tmp_path / "checkpoints"
    path = save_checkpoint(ckpt, 4, _state(4), layout=LAYOUT)
    _edit_manifest(path, edit)
    with pytest.raises(CheckpointError, match=r"manifest\.json is malformed: " + message) as info:
        verify_checkpoint(path, world_size=1, layout=LAYOUT)
    assert "\n" not in str(info.value)
