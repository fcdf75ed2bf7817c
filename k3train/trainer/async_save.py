"""Checkpoint saves that do not stop training (``train.async_save``).

``CheckpointWriter.save`` takes the rank's state as a host-memory snapshot (the only part that
holds the step), into the writer's ``HostBuffers`` (pinned on CUDA, allocated at the first save
and refilled by each later one), and hands it to a background thread, which runs the ordinary
``save_checkpoint``: rank files into ``.tmp-step_*``, the ranks' outcomes exchanged, and only
when every rank's file is complete the manifest, the rename and ``latest`` (the commit). The
next steps train meanwhile. At most one save is in flight: a second ``save`` first waits for the
previous one (and raises its error). The background save's exchanges run over a gloo group of
their own, made once when the writer is built (collectively, on every rank), so they never
interleave with the training step's collectives.

With ``asynchronous=False`` (the default) ``save`` is the plain synchronous save.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from k3train.trainer.checkpoint import save_checkpoint
from k3train.trainer.host_buffers import HostBuffers


class CheckpointWriter:
    """Writes the run's checkpoints, synchronously or in the background (see the module doc).
    Build it on every rank at the same point (it makes a process group when asynchronous)."""

    def __init__(self, *, asynchronous: bool = False):
        self.asynchronous = asynchronous
        self.group = None
        # the snapshot's host tensors (k3train/trainer/host_buffers.py); None: a synchronous save
        self.host = HostBuffers() if asynchronous else None
        if asynchronous and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: Path | None = None

    def save(self, ckpt_dir: Path, step: int, build: Callable[[], tuple[dict, dict]], **kwargs) -> None:
        """Save step ``step``: ``build()`` returns (rank file content, piece index), a snapshot
        in host memory when asynchronous (``rank_state(..., host=writer.host)``); it is called only
        after the previous save has finished, so at most one snapshot is held. ``kwargs`` go to
        ``save_checkpoint``. Collective, like ``save_checkpoint``."""
        self.wait()
        content, index = build()
        if not self.asynchronous:
            self.last = save_checkpoint(ckpt_dir, step, content, index=index, **kwargs)
            return

        def write():
            try:
                self.last = save_checkpoint(ckpt_dir, step, content, index=index, group=self.group, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=write, name=f"k3train-save-{step}")
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) has committed; raise its error (a
        ``CheckpointError``, one line) here, in the training thread. Returns the last step
        directory saved."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last
