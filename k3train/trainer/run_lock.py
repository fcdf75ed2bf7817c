"""One run per run directory: an exclusive ``fcntl.flock`` on ``RUN_DIR/run.lock``.

Two runs writing one directory interleave their metrics and race on the checkpoint pointer
(``.latest.tmp`` vanishing under the other run). The run's rank 0 takes the lock before it
touches anything in the directory (``config.yaml``, ``metrics.jsonl``, ``checkpoints/``) and
holds it until the run ends; a second run refuses at once, naming the holder's PID and host.

* The kernel drops the lock when the holder exits in any way (a SIGKILL included), so a dead
  run never leaves the directory locked. A run that ends (finished, failed or stopped) removes
  the file while it still holds the lock; only a killed run leaves it behind, naming no live
  holder. Removing it is safe because a run that locked a file checks that the path still names
  that file (same inode) and otherwise starts over: a run that opened the old file just before
  it was removed cannot then hold the lock next to one that created the new file.
* Only global rank 0 locks: under torchrun the other ranks write only inside checkpoint
  directories that rank 0 creates. Per-host locks would collide on a shared filesystem, where
  every host's rank 0 would try the same file.
* ``flock`` is advisory (only k3train runs honour it); on NFS Linux emulates it with POSIX
  byte-range locks (flock(2)), which also exclude a second run on another host.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from k3train.errors import RunDirError

LOCK_NAME = "run.lock"


class RunDirLock:
    """``with RunDirLock(run_dir):`` holds the run directory's lock (creating the directory);
    raises ``RunDirError`` when another run holds it. ``enabled=False`` (ranks other than 0)
    does nothing."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True):
        self.path = Path(run_dir) / LOCK_NAME
        self.enabled = enabled
        self._fd: int | None = None

    def __enter__(self) -> "RunDirLock":
        if not self.enabled:
            return self
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise RunDirError(f"run directory {self.path.parent} is a file, not a directory; "
                              f"pass another --run-dir or move the file away")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by another run ({holder}; lock "
                    f"{self.path}); wait for that run to end or stop it, or pass another --run-dir") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the previous holder removed the file we opened: lock the current one
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        if _same_file(self._fd, self.path):  # ours: removed while still locked (module doc)
            self.path.unlink()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the open file ``fd`` (it may have been removed or replaced)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"PID {holder['pid']} on host {holder['host']}"
    except (ValueError, KeyError, TypeError):
        return "a run that is still starting (its PID and host are not written yet)"
