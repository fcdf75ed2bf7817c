"""What a run may do with its run directory, decided before any training (docs/run_directory.md).

* A run without ``--resume`` refuses a directory that already holds a run (checkpoints or
  ``metrics.jsonl``): two runs in one directory would mix their metrics, and the pruning of old
  checkpoints would delete the new run's (lower-numbered) ones. ``--overwrite`` first moves the
  old run's files into ``archive/<UTC time>/`` inside the directory: nothing is deleted.
* ``--resume`` continues from the checkpoint ``latest`` names. When ``latest`` is missing,
  malformed, or names a step that is gone or does not verify, it takes the newest step
  directory that verifies, and says so. When step
  directories exist but none verifies, it refuses rather than start over. With no step
  directory at all it starts from step 0, as a requeued job's or an elastic restart's first
  attempt needs; metrics of a run that died before its first save are archived first.
* A directory (or its ``checkpoints/``) that cannot be written is refused here, not at the
  first save.

Rank 0 decides (and archives); the decision, or its refusal, reaches every rank through one
broadcast, so all ranks stop together instead of some waiting in a collective.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch.distributed as dist
import yaml

from k3train.config import RunConfig, dump_config
from k3train.errors import CheckpointError, K3TrainError, RunDirError
from k3train.runtime.files import write_text_atomic
from k3train.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from k3train.trainer.run_lock import LOCK_NAME

T = TypeVar("T")
ARCHIVE = "archive"


def decided_on_rank0(decide: Callable[[], T]) -> T:
    """Run ``decide`` on global rank 0 only and return its result on every rank; a K3TrainError
    it raises is raised on every rank. Any other exception (a bug) keeps its traceback on rank 0,
    and the other ranks stop with a line pointing there instead of waiting for rank 0."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    outcome: list = [None, None]
    bug = None
    if rank == 0:
        try:
            outcome[0] = decide()
        except K3TrainError as exc:
            outcome[1] = exc
        except Exception as exc:  # noqa: BLE001 - re-raised below, on rank 0 with its traceback
            bug, outcome[1] = exc, RunDirError(f"rank 0 failed while checking the run directory "
                                               f"({type(exc).__name__}: {exc}); see rank 0's traceback")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if bug is not None:
        raise bug
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def _step_dirs(ckpt_dir: Path) -> list[Path]:
    return sorted((p for p in ckpt_dir.glob("step_*") if p.is_dir()), reverse=True) if ckpt_dir.is_dir() else []


def holds_a_run(run_dir: Path) -> bool:
    """True when ``run_dir`` has a run's metrics or checkpoints (config.yaml alone does not
    count: a run that died before its first step leaves nothing to keep)."""
    ckpt = run_dir / "checkpoints"
    return (run_dir / "metrics.jsonl").exists() or (ckpt / "latest").exists() or bool(_step_dirs(ckpt))


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` and write a probe file in it and in ``checkpoints/`` if that exists
    (the first save creates it inside a writable run_dir); raise RunDirError naming the path
    that cannot be used."""
    ckpt = run_dir / "checkpoints"
    for path in (run_dir, ckpt):
        if path.exists() and not path.is_dir():
            raise RunDirError(f"{path} is a file, not a directory; move it away or choose another --run-dir")
        if path == ckpt and not path.exists():
            continue
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            raise RunDirError(f"run directory {path} cannot be written ({exc.strerror}); "
                              f"fix its permissions or choose another --run-dir") from None


def archive_run(run_dir: Path) -> Path:
    """Move every entry of ``run_dir`` but ``archive/``, the run lock (held by the run that is
    archiving: moving it would unlock the directory) and hidden files (temporary files of a
    running save) into ``run_dir/archive/<UTC time>/``; returns that directory."""
    dest = run_dir / ARCHIVE / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base, n = dest, 1
    while dest.exists():  # two overwrites within one second
        dest, n = base.with_name(f"{base.name}-{n}"), n + 1
    try:
        dest.mkdir(parents=True)
        for entry in sorted(run_dir.iterdir()):
            if entry.name not in (ARCHIVE, LOCK_NAME) and not entry.name.startswith("."):
                shutil.move(str(entry), str(dest / entry.name))
    except OSError as exc:
        raise RunDirError(f"archiving the previous run in {run_dir} to {dest} failed at {exc.filename or dest} "
                          f"({exc.strerror or exc}); what was moved is in {dest}, the rest is where it was") from None
    return dest


def _newest_verified(ckpt_dir: Path, world_size: int, layout: dict) -> tuple[Path | None, list[str]]:
    """The newest step directory that verifies, and why each newer one did not."""
    refused = []
    for path in _step_dirs(ckpt_dir):
        try:
            verify_checkpoint(path, world_size, layout)
            return path, refused
        except CheckpointError as exc:
            refused.append(f"{path.name}: {exc}")
    return None, refused


def plan_run_dir(run_dir: Path, resume: bool, overwrite: bool, world_size: int, layout: dict,
                 log: Callable[[str], None] = print) -> Path | None:
    """Check (and with ``overwrite`` archive) ``run_dir``; return the checkpoint to resume from,
    or None to start at step 0. Raises RunDirError or CheckpointError instead of starting a run
    that would mix with, or silently replace, the one already there."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other: --resume continues the run in "
                          f"{run_dir}, --overwrite archives it and starts over; pass one")
    check_writable(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if overwrite:
        if holds_a_run(run_dir):
            log(f"[k3train] --overwrite: moved the previous run's files to {archive_run(run_dir)}")
        return None
    if not resume:
        if holds_a_run(run_dir):
            raise RunDirError(f"{run_dir} already holds a run (checkpoints or metrics.jsonl); pass --resume to "
                              f"continue it, or --overwrite to move its files to {run_dir / ARCHIVE}/<time>/ "
                              f"and start over, or choose another --run-dir")
        return None
    if (ckpt_dir / "latest").is_dir():
        latest_checkpoint(ckpt_dir)  # refuses: a directory there would block every later save
    try:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            why = f"{ckpt_dir / 'latest'} is missing"
        else:
            verify_checkpoint(path, world_size, layout)
            return path
    except CheckpointError as exc:  # a bad pointer, or the step it names is gone or corrupt
        why = str(exc)
    path, refused = _newest_verified(ckpt_dir, world_size, layout)
    if path is not None:
        skipped = f" (skipped: {'; '.join(refused)})" if refused else ""
        log(f"[k3train] --resume: {why}; resuming from {path.name}, the newest checkpoint that verifies{skipped}")
        return path
    if refused:
        raise CheckpointError(f"--resume: no checkpoint in {ckpt_dir} verifies: {'; '.join(refused)}; refusing "
                              f"to start over in a directory that holds a run. Pass --overwrite to archive it "
                              f"and start from step 0, or choose another --run-dir")
    if holds_a_run(run_dir):
        # Metrics but no step directory at all: a run that stopped before its first save (an
        # elastic restart's first attempt, say). Nothing can be resumed and nothing is lost by
        # starting over, as long as its files are kept: they are archived, never deleted.
        dest = archive_run(run_dir)
        log(f"[k3train] --resume: {run_dir} holds no checkpoint (the run stopped before its first save); "
            f"its files moved to {dest}; starting from step 0")
        return None
    log(f"[k3train] --resume: nothing to resume in {run_dir} (no checkpoints, no metrics): starting from step 0")
    return None


def load_error(path: Path, exc: Exception, run_dir: Path) -> CheckpointError:
    """A checkpoint's state that does not fit the model (torch's multi-line load_state_dict
    error, or a missing key) as one line naming the first mismatch."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    first = next((ln for ln in lines if ln.startswith(("size mismatch", "Missing key", "Unexpected key"))),
                 lines[-1] if lines else type(exc).__name__)
    return CheckpointError(f"checkpoint {path} does not fit this run's model or optimizer ({first.rstrip('.')}); "
                           f"resume with the config it was saved with ({run_dir / 'config.yaml'} has it), "
                           f"or start over with --overwrite")


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write a run's resolved config (``RUN_DIR/config.yaml``) atomically (temp file + rename)."""
    write_text_atomic(path, dump_config(cfg))


# Settings a resumed run keeps from its own config.yaml whatever the config it is resumed with
# says, and the value a config.yaml recorded before the setting existed stands for (what those
# runs did). Changing one mid-run would change what the model trains on under the same run.
RECORDED_ON_RESUME = {("data", "document_mask"): False}


def keep_recorded_settings(cfg: RunConfig, run_dir: Path, log: Callable[[str], None] = print) -> RunConfig:
    """``cfg`` with ``RECORDED_ON_RESUME``'s settings taken from ``run_dir/config.yaml`` (the run
    being resumed); a key the file lacks takes its pre-key value. No config.yaml: ``cfg`` as is."""
    path = Path(run_dir) / "config.yaml"
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return cfg
    tree = tree if isinstance(tree, dict) else {}
    for (section, key), old_default in RECORDED_ON_RESUME.items():
        part = tree.get(section)
        recorded = part.get(key, old_default) if isinstance(part, dict) else old_default
        current = getattr(getattr(cfg, section), key)
        if recorded != current:
            log(f"[k3train] --resume: {section}.{key}={recorded} as {path} recorded it (the given config says "
                f"{current}); a run keeps it from its first step")
        cfg = cfg.model_copy(update={section: getattr(cfg, section).model_copy(update={key: recorded})})
    return cfg
