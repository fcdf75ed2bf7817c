"""Atomic writes: one file (temp file + fsync + rename) and one output directory (temp sibling +
rename, never replacing what the command did not write).

A reader (or a crash) sees the old content or the new, never half of either. Every module that
writes a file others read back (configs, checkpoint pointers, metrics summaries, exports,
imports) goes through here.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator

from k3train.errors import K3TrainError

# The file an output directory's writer leaves in it, naming the command that wrote it: the
# only proof that a directory is a previous output that --overwrite may replace.
OUTPUT_MANIFEST = "k3train_output.json"
# Any of these makes a directory a run's (or a run in progress): never an output target.
RUN_MARKERS = ("checkpoints", "metrics.jsonl", "run.lock")


class OutputDirError(K3TrainError):
    """An output directory cannot be written as asked (a run's, someone else's, or exists)."""


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str, *, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` through a hidden temp file in the same directory, fsynced, then
    renamed over ``path``. mode: the file's permission bits (default: 0666 minus the umask, as
    ``open`` gives; ``mkstemp`` alone would give 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def default_file_mode() -> int:
    """0666 minus the process's umask: what a plain ``open(..., "w")`` creates."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def writable_ancestor_problem(path: Path) -> str | None:
    """Why an output at ``path`` cannot be created, or None: its nearest existing ancestor must
    be a writable directory (what is missing in between is created)."""
    for above in (path, *path.parents):
        if above.exists():
            if not above.is_dir():
                return f"{above} is a file, not a directory"
            if not os.access(above, os.W_OK | os.X_OK):
                return f"directory {above} is not writable"
            return None
    return None


def output_manifest(path: Path) -> dict | None:
    """The output manifest of directory ``path`` (None when it has none or it is unreadable)."""
    try:
        data = json.loads((path / OUTPUT_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_output_target(out: Path, command: str, overwrite: bool) -> None:
    """Refuse (``OutputDirError``, nothing changed) an ``out`` that ``command`` must not replace:
    a file, a run directory, a non-empty directory that is not ``command``'s previous output,
    or its previous output without ``overwrite``. An absent or empty directory is fine."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputDirError(f"--out {out} is a file; choose a directory path")
    entries = [p.name for p in out.iterdir()]
    if not entries:
        return
    theirs = output_manifest(out)
    run = [m for m in RUN_MARKERS if (out / m).exists()]
    own_output = theirs is not None and theirs.get("command") == command
    # An import writes a run directory's config.yaml and checkpoints/ itself: those alone do
    # not make it a run, a run's metrics or lock do.
    if run and not (own_output and command == "import" and not {"metrics.jsonl", "run.lock"} & set(run)):
        raise OutputDirError(f"--out {out} holds a training run ({', '.join(run)}); it is never replaced "
                             f"by {command}: choose a new directory")
    if not own_output:
        what = f"written by {theirs.get('command')!r}" if theirs else f"not written by {command} (no {OUTPUT_MANIFEST})"
        raise OutputDirError(f"--out {out} is a non-empty directory {what}; {command} writes only into a new "
                             f"or empty directory, or over its own previous output: choose another --out")
    if not overwrite:
        raise OutputDirError(f"--out {out} holds a previous {command} output; pass --overwrite to replace it, "
                             f"or choose another --out")


@contextlib.contextmanager
def output_dir(out: str | os.PathLike, *, command: str, overwrite: bool = False,
               details: dict | None = None) -> Iterator[Path]:
    """Yield a new temporary sibling of ``out`` to write into; on success it gets the output
    manifest (``command``, time, ``details``), its files are fsynced, and it is renamed into
    place. ``out`` is checked first (``check_output_target``) and again just before the swap.
    An existing ``out`` (a previous output of ``command``, with ``overwrite``) is renamed aside
    and removed only after the new one is in place. On an exception the temporary directory
    is removed and ``out`` is untouched."""
    out = Path(os.path.abspath(out))  # "." or "x/..": its real parent holds the temporary sibling
    check_output_target(out, command, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.parent / f".tmp-{out.name}-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        write_text_atomic(tmp / OUTPUT_MANIFEST, json.dumps(
            {"command": command, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             **(details or {})}, indent=1), mode=default_file_mode())
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        check_output_target(out, command, overwrite)  # nothing appeared there meanwhile
        old = out.parent / f".old-{out.name}-{tag}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
