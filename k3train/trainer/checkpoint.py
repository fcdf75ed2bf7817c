"""Atomic, verified checkpoints.

Layout of a run directory's ``checkpoints/``:
    step_00000100/rank_00000.pt ...   one file per rank (its pieces of the model and optimizer,
                                      its data and RNG state; ``k3train.trainer.state_io``)
    step_00000100/manifest.json       step, world layout, sha256 and size of every rank file, and
                                      the index of every tensor's pieces by global name
    latest                            text file naming the newest complete step directory

A save writes into ``.tmp-step_...``, fsyncs, renames the directory into place, and only then
rewrites ``latest`` (itself via a temp file + rename). A crash at any moment therefore leaves
the previous checkpoint and pointer intact. ``--resume`` verifies every checksum before loading
and names the corrupted file if one does not match.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from k3train.errors import CheckpointError
from k3train.runtime.files import fsync_dir, write_text_atomic
from k3train.trainer import faults

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "verify_checkpoint"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# sha256 of rank files this process has verified, by file identity and change stamps. A resume
# verifies the checkpoint twice on rank 0 (the run directory's plan, then the load), which at K3
# scale meant reading tens of GiB twice; the second pass now reads only the stamps. Any write to
# a file changes its ctime (which no tool can set), so a changed file is hashed again.
_VERIFIED: dict[tuple, str] = {}


def _verified_sha256(path: Path) -> str:
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _VERIFIED:
        if len(_VERIFIED) > 4096:  # a long-lived process (a sweep) opens many checkpoints
            _VERIFIED.clear()
        _VERIFIED[key] = _sha256(path)
    return _VERIFIED[key]


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _gather(value: Any, group=None) -> list:
    """Every rank's ``value`` (a collective over ``group``, default the world; also the save's
    synchronisation point)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` (nested dicts/lists): about what its file needs."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _free_text(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free:,} bytes free there"
    except OSError:
        return "free space unknown"


def _previous(ckpt_dir: Path) -> str:
    """What a failed save leaves to resume from, for its message."""
    try:
        path = latest_checkpoint(ckpt_dir)
    except CheckpointError:
        path = None
    return f"the previous checkpoint ({path.name}) is intact" if path is not None else "no earlier checkpoint exists"


def _save_failed(ckpt_dir: Path, step: int, where: Path, exc: OSError, needed: int) -> str:
    return (f"saving checkpoint step {step} failed at {where}: {exc.strerror or exc}; it needs about "
            f"{needed:,} bytes per rank ({_free_text(ckpt_dir if ckpt_dir.is_dir() else ckpt_dir.parent)}); "
            f"its temporary directory was removed and {_previous(ckpt_dir)}")


def _behind(exc: BaseException, kind) -> BaseException | None:
    """The exception of type ``kind`` behind ``exc``: torch.save reports a failed write of its
    zip writer (a full disk, an interrupt) as ``RuntimeError: unexpected pos ...`` raised while
    handling the original one."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, kind):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _os_error(exc: BaseException) -> OSError | None:
    return _behind(exc, OSError)


def check_free_space(ckpt_dir: Path, step: int, needed: int) -> None:
    """Refuse (one line: the path, the bytes needed and free) a save of about ``needed`` bytes
    (every rank file's tensor bytes) where the file system has less free."""
    try:
        free = shutil.disk_usage(ckpt_dir).free
    except OSError:
        return  # unknown: the write itself reports a shortfall
    if free < needed:
        raise CheckpointError(f"saving checkpoint step {step} refused: {ckpt_dir} has {free:,} bytes free, the "
                              f"checkpoint needs about {needed:,} bytes (its tensors); free space there or lower "
                              f"checkpoint.keep_last; nothing was written and {_previous(ckpt_dir)}")


def save_checkpoint(ckpt_dir: str | os.PathLike, step: int, state: dict[str, Any], layout: dict,
                    keep_last: int = 2, coords: dict | None = None, index: dict | None = None,
                    group=None) -> Path:
    """Collective: every rank passes its own ``state`` (and its parallel ``coords``, recorded
    in the manifest so a run with another data-parallel size can find its source rank);
    returns the final directory.

    index: this rank's pieces by global tensor name (``k3train.trainer.state_io.rank_state``);
    given on every rank, the manifest merges them into ``tensors`` (global name -> shape and the
    file, dim, offset and length of each piece), which lets any layout load the checkpoint.

    Before writing, rank 0 refuses a save whose tensors (every rank's) need more than the free
    space of ``ckpt_dir`` (``check_free_space``). An OSError on any rank (a full disk, most
    often, which torch.save may surface as a RuntimeError) removes the temporary directory and
    raises CheckpointError on every rank, naming the path, the bytes needed and the free space:
    the ranks exchange their outcome at each stage instead of waiting in a barrier for a rank
    that died. An interrupt removes the partial files too; the previous checkpoint stays.

    group: the process group of the save's own exchanges (default the world's); a save written
    by a background thread (``k3train.trainer.async_save``) uses a group of its own, so its
    collectives never interleave with the training step's."""
    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    final, tmp = ckpt_dir / _step_name(step), ckpt_dir / f".tmp-{_step_name(step)}"
    needed = _state_bytes(state)
    total = sum(_gather(needed, group))  # every rank's file lands in the same directory

    def stage(work) -> list:
        error = None
        try:
            work()
        except CheckpointError as exc:
            error = str(exc)
        except (OSError, RuntimeError) as exc:
            os_error = _os_error(exc)
            if os_error is None:
                raise  # not an I/O error: a bug, with its traceback
            error = _save_failed(ckpt_dir, step, Path(os_error.filename or tmp), os_error, needed)
        outcomes = _gather(error, group)
        failed = [e for e in outcomes if e is not None]
        if failed:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(failed[0])
        return outcomes

    def prepare():
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            # Temporary directories of saves a kill interrupted are never read: reclaim their space.
            for stale in ckpt_dir.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
            check_free_space(ckpt_dir, step, total)
            tmp.mkdir()

    def write_rank_file():
        rank_file = tmp / f"rank_{rank:05d}.pt"
        try:
            with open(rank_file, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as exc:
            rank_file.unlink(missing_ok=True)  # a partial file never stays, whatever stopped the write
            interrupt = _behind(exc, (KeyboardInterrupt, SystemExit))
            if interrupt is not None and interrupt is not exc:
                raise interrupt from None  # the interrupt itself, not torch's wrapper
            os_error = _os_error(exc)
            if os_error is not None:
                os_error.filename = os_error.filename or str(rank_file)
            raise

    def publish():
        if rank != 0:
            return
        files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in sorted(tmp.glob("rank_*.pt"))}
        if len(files) != len(all_coords):
            raise CheckpointError(f"expected {len(all_coords)} rank files in {tmp}, found {len(files)}")
        manifest = {"step": step, "world_size": len(all_coords), "layout": layout, "files": files,
                    "coords": {str(r): c for r, c in enumerate(all_coords) if c is not None}}
        if index is not None:
            manifest.update(format=state["format"], optim_step=state["optim_step"],
                            tensors=_merge_index(all_index))
            if state.get("optim_name"):
                manifest["optim_name"] = state["optim_name"]
            if state.get("data_record"):  # what the run trains on (a resume on other data is refused)
                manifest["data"] = state["data_record"]
        write_text_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1))
        fsync_dir(tmp)
        if final.exists():  # an earlier save of the same step (e.g. after a resume) is replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(ckpt_dir)
        write_text_atomic(ckpt_dir / "latest", final.name)
        _prune(ckpt_dir, keep_last, step)

    try:
        stage(prepare)
        stage(write_rank_file)
        all_coords = _gather(coords, group)
        all_index = _gather(index, group)
        faults.maybe_slow_save(step)
        stage(publish)
    except BaseException:
        # An interrupt (KeyboardInterrupt, a second signal) or a refusal: the partial save goes,
        # the previous checkpoint and 'latest' stay.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _merge_index(per_rank: list[dict]) -> dict:
    """Every rank's {global name: piece} as {global name: {"shape", "optim", "pieces": [...]}}."""
    out: dict = {}
    for rank, index in enumerate(per_rank):
        for name, p in sorted(index.items()):
            entry = out.setdefault(name, {"shape": p["shape"], "optim": p.get("optim", []), "pieces": []})
            if p.get("optimizer"):
                entry["optimizer"] = p["optimizer"]
            entry["pieces"].append({"file": f"rank_{rank:05d}.pt", "dim": p["dim"], "offset": p["offset"],
                                    "length": p["length"]})
    for entry in out.values():
        entry["pieces"].sort(key=lambda p: p["offset"])
    return out


def _prune(ckpt_dir: Path, keep_last: int, step: int) -> None:
    """Keep the ``keep_last`` newest checkpoints up to ``step``, the one just saved. Directories
    of later steps (a resume from an older checkpoint) are never pruned in their favour: keeping
    "the highest numbers" once deleted the checkpoint just written."""
    steps = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir() and p.name <= _step_name(step))
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The directory named by ``latest``, or None when the run has no checkpoint yet.

    ``latest`` must be a file naming one ``step_XXXXXXXX`` directory of this ``checkpoints/``
    (what ``save_checkpoint`` writes): a pointer that is a directory, not text, empty, ``..``, an
    absolute path or a name of another form is refused (``CheckpointError``), never followed into
    another run."""
    pointer = Path(ckpt_dir) / "latest"
    if pointer.is_dir():
        raise CheckpointError(f"{pointer} is a directory, not the pointer file k3train writes; move it "
                              f"out of {ckpt_dir} (it would block every save)")
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer} is not text; it should name a step_XXXXXXXX directory") from None
    if not re.fullmatch(r"step_\d{8}", name):
        raise CheckpointError(f"{pointer} names {name!r}, not a step_XXXXXXXX directory of {ckpt_dir}")
    target = Path(ckpt_dir) / name
    if not target.is_dir():
        raise CheckpointError(f"{pointer} names {target.name}, which does not exist")
    if target.resolve().parent != Path(ckpt_dir).resolve():  # a step symlinked to another run's
        raise CheckpointError(f"{pointer} names {name}, which leads out of {ckpt_dir} (to {target.resolve()})")
    return target


_LAYOUT_KEYS = ("tp", "pp", "vpp", "ep", "dp", "zero1")
# Model and optimizer states are replicated over data-parallel ranks unless ZeRO-1 shards the
# optimizer, so a checkpoint survives a change of dp alone: each rank reads a file of a rank
# with the same (pp, tp, ep) coordinates.
_DP_RESIZABLE = ("tp", "pp", "vpp", "ep", "zero1")


def _source_rank(manifest: dict, coords: dict | None) -> int | None:
    for rank, theirs in sorted(manifest.get("coords", {}).items(), key=lambda kv: int(kv[0])):
        if coords is not None and all(theirs[k] == coords[k] for k in ("pp", "tp", "ep")):
            return int(rank)
    return None


def _check_manifest(manifest: Any, path: Path, manifest_file: Path) -> None:
    """The manifest's structure, before anything reads it: a malformed one used to end in a
    bare KeyError or AttributeError, and one listing no files verified as complete."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{manifest_file} is malformed: {what}; the checkpoint cannot be trusted, "
                               f"resume from another step directory")
    if not isinstance(manifest, dict):
        raise bad(f"expected a JSON object, got {type(manifest).__name__}")
    missing = [k for k in ("step", "world_size", "layout", "files") if k not in manifest]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    step, world, files = manifest["step"], manifest["world_size"], manifest["files"]
    if not (isinstance(step, int) and isinstance(world, int) and world >= 1 and isinstance(manifest["layout"], dict)):
        raise bad(f"step {step!r}, world_size {world!r}, layout of type {type(manifest['layout']).__name__}")
    if path.name.startswith("step_") and path.name != _step_name(step):
        raise bad(f"it records step {step}, but its directory is {path.name}")
    expected = [f"rank_{r:05d}.pt" for r in range(world)]
    if not isinstance(files, dict) or sorted(files) != expected:
        listed = sorted(files) if isinstance(files, dict) else files
        raise bad(f"files lists {listed or 'nothing'}, expected one per rank: {', '.join(expected)}")
    for name, meta in files.items():
        if not (isinstance(meta, dict) and isinstance(meta.get("sha256"), str) and isinstance(meta.get("bytes"), int)):
            raise bad(f"entry {name} needs a sha256 string and a bytes count, got {meta!r}")
    if not isinstance(manifest.get("coords", {}), dict):
        raise bad("coords is not an object")


def verify_checkpoint(path: Path, world_size: int, layout: dict | None = None) -> dict:
    """Check the manifest (world size and, if given, the parallel layout) and every checksum;
    return the manifest or raise naming the bad file or the mismatch. A layout that differs in
    the data-parallel size alone (ZeRO-1 off) is accepted: see ``load_checkpoint``. A checkpoint
    stored by global tensor name (its manifest has ``tensors``) is accepted under any layout."""
    manifest_file = path / "manifest.json"
    if not manifest_file.is_file():
        raise CheckpointError(f"checkpoint {path} has no manifest.json: it is incomplete")
    try:
        manifest = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{manifest_file} is not valid JSON ({exc})") from None
    _check_manifest(manifest, path, manifest_file)
    saved = manifest["layout"]
    if "tensors" in manifest:
        pass  # stored by global name: any layout loads it (k3train.trainer.state_io)
    elif layout is None:
        if manifest["world_size"] != world_size:
            raise CheckpointError(f"checkpoint {path} was written by {manifest['world_size']} ranks, "
                                  f"this run has {world_size}; resume with the same parallel layout")
    else:
        diff = [f"{k}={saved.get(k)} (now {layout.get(k)})" for k in _LAYOUT_KEYS if saved.get(k) != layout.get(k)]
        dp_only = all(saved.get(k) == layout.get(k) for k in _DP_RESIZABLE) and not layout.get("zero1")
        if diff and not dp_only:
            raise CheckpointError(f"checkpoint {path} was written with a different parallel layout: "
                                  f"{', '.join(diff)}; resume with the layout it was saved with (only the "
                                  f"data-parallel size may change, and only without optim.zero1)")
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        if f.stat().st_size != meta["bytes"] or _verified_sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupted (checksum mismatch); "
                                  f"delete {path} and point 'latest' at an older step to resume from it")
    return manifest


def load_checkpoint(path: Path, layout: dict | None = None, coords: dict | None = None) -> tuple[dict, dict]:
    """Verify ``path`` and return (manifest, this rank's state).

    coords: this rank's {"pp", "tp", "ep", "dp"} indices; when the data-parallel size changed,
    the state comes from the first saved rank with the same (pp, tp, ep) coordinates.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    manifest = verify_checkpoint(path, world, layout)
    source = rank
    if layout is not None and manifest["layout"].get("dp") != layout.get("dp"):
        source = _source_rank(manifest, coords)
        if source is None:
            raise CheckpointError(f"checkpoint {path} has no rank with coordinates {coords}")
    state = torch.load(path / f"rank_{source:05d}.pt", map_location="cpu", weights_only=False)
    return manifest, state
