"""Host tensors that a checkpoint snapshot copies into, kept from one save to the next.

An asynchronous save (``train.async_save``) stops training only while the rank's state is
copied to the host. A fresh host tensor per save made that copy slow: every page of a new
pageable allocation is faulted in as it is written (about 1.6 GiB/s on the H200 machine, 30 s
for the K3 slice's 49 GiB). Here each tensor gets one host buffer, allocated at the first save
(page-locked on CUDA, so the device-to-host copies run at PCIe speed without a staging copy)
and refilled in place by every later save. At most one save is in flight
(``CheckpointWriter``), so a buffer is refilled only after the previous write has read it.
The price: the host keeps one checkpoint's worth of memory (pinned on CUDA) for the run.
"""
from __future__ import annotations

import copy

import torch


class HostBuffers:
    """{key: host tensor}, refilled by ``copy``; ``ready()`` before anything reads them."""

    def __init__(self):
        self._buffers: dict[object, torch.Tensor] = {}
        self._pending_cuda = False

    def copy(self, key, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (any shape, dtype, device) in the buffer kept under ``key``:
        the same storage as the last ``copy`` under that key when the shape and dtype match,
        never ``t``'s own storage. On CUDA the copy is asynchronous until ``ready()``."""
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        self._pending_cuda |= t.is_cuda
        return buf

    def copy_tree(self, key, obj):
        """``obj`` (nested dicts, lists and tuples of tensors and plain values) with every tensor
        copied by ``copy`` under ``(key, path)`` and every other value deep-copied."""
        if isinstance(obj, torch.Tensor):
            return self.copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.copy_tree((key, k), v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy_tree((key, i), v) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def ready(self) -> None:
        """Wait for the copies issued so far (the device work before them included)."""
        if self._pending_cuda:
            torch.cuda.synchronize()
            self._pending_cuda = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
