"""Activation offload to host memory (``train.offload_activations``): what recompute keeps, on the host.

Under ``train.recompute=full`` a layer keeps only its checkpoint region's inputs (the hidden
state or the AttnRes partial sum, and the blocks it reads); at long sequences these are what
grows with the number of layers (k3_mini at 1M tokens: 17 tensors of ``[1, T, 1024]`` bf16, 34
GiB, docs/long_context.md). ``ActivationOffload.hooks()`` is a saved-tensor hook pair that copies
every saved tensor of at least ``min_bytes`` to host memory in the forward (pinned, on a side
stream, so the copy overlaps the next layer's compute) and copies it back when the backward
unpacks it (the region's recompute). ``k3train.model.recompute.run_layer`` opens it around the
checkpoint call, so it sees exactly the region's saved inputs (and under ``selective`` the
cores' kept outputs and saved tensors); the tensors saved *inside* a region are checkpoint
placeholders and are never offloaded. Under offload ``run_layer`` cuts each layer into two
regions (mixer half, FFN half), so the mixer half's output is one more kept tensor per layer.

A tensor saved by several regions (an AttnRes block is read by every later layer and the final
depth mix) is copied once: the packed copy is remembered per tensor (weakly, so the GPU tensor
can still be freed) and shared while the tensor's version is unchanged; a saved view of such a
tensor (a block's token piece under ``train.recompute_pieces``) is kept as the same view of its
host copy.

Bitwise: the round trip is a copy, so losses and gradients equal those without offload
(tests/model/test_offload.py). Not with CUDA graphs (the copies allocate host memory and sync
on events; ``train.cuda_graph`` resolves off, see ``layout_rules.cuda_graph_blockers``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass
class OffloadStats:
    """What the hooks did since the last ``reset_stats``: tensors copied to the host and their bytes,
    saves served by an earlier copy of the same tensor, tensors copied back, tensors left on
    the device (smaller than ``min_bytes``)."""

    offloaded: int = 0
    offloaded_bytes: int = 0
    shared: int = 0
    restored: int = 0
    kept: int = 0


class _HostCopy:
    """A saved tensor's host copy: ``host`` (same shape, dtype, strides contiguous), the device
    it came from, and on CUDA the event after which the copy is complete."""

    __slots__ = ("host", "device", "event")

    def __init__(self, host: torch.Tensor, device: torch.device, event):
        self.host, self.device, self.event = host, device, event


class _HostView:
    """A saved view of a tensor already copied to the host: the same view of that copy (the
    base's copy is contiguous, as the base is), so a block read in pieces is kept once."""

    __slots__ = ("copy", "size", "stride", "offset")

    def __init__(self, copy: _HostCopy, size, stride, offset: int):
        self.copy, self.size, self.stride, self.offset = copy, size, stride, offset


class ActivationOffload:
    """Saved-tensor hooks that keep large saved tensors in host memory (module docstring).

    min_bytes: tensors smaller than this stay where they are (norms' rstd, router ids: their
    copies would cost more in latency than they save). One object per model chunk; the side
    stream is made on first use on CUDA."""

    def __init__(self, *, min_bytes: int = 1 << 20):
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        # id(tensor) -> (weak reference to it, its version when copied, the copy). By id, not
        # a WeakKeyDictionary: tensors compare elementwise, a dictionary must not call ==.
        self._copies: dict[int, tuple[weakref.ref, int, _HostCopy]] = {}
        self._stream = None

    def reset_stats(self) -> None:
        self.stats = OffloadStats()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context in which saved tensors go to the host."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or t.layout != torch.strided:
            self.stats.kept += 1
            return t
        key = id(t)
        entry = self._copies.get(key)
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            self.stats.shared += 1
            return entry[2]
        base = t._base
        entry = self._copies.get(id(base)) if base is not None else None
        if entry is not None and entry[0]() is base and entry[1] == base._version and base.is_contiguous():
            # A view (a token piece, train.recompute_pieces) of a tensor already on the host.
            self.stats.shared += 1
            return _HostView(entry[2], t.size(), t.stride(), t.storage_offset() - base.storage_offset())
        copy = self._to_host(t)
        copies = self._copies
        # The entry goes when the tensor does (its id may then be reused by another tensor).
        self._copies[key] = (weakref.ref(t, lambda _ref, k=key: copies.pop(k, None)), t._version, copy)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += nbytes
        return copy

    def unpack(self, packed):
        view = None
        if isinstance(packed, _HostView):
            view, packed = packed, packed.copy
        if not isinstance(packed, _HostCopy):
            return packed
        self.stats.restored += 1
        host = packed.host if view is None else packed.host.as_strided(view.size, view.stride, view.offset)
        if packed.device.type != "cuda":
            # A host run (tests, CPU): the copy itself comes back (bitwise the saved tensor).
            return host
        # The host copy is complete once its event has passed; the copy back runs in order on
        # the stream that needs it (the backward's).
        torch.cuda.current_stream(packed.device).wait_event(packed.event)
        return host.to(packed.device, non_blocking=True)

    def _to_host(self, t: torch.Tensor) -> _HostCopy:
        if t.device.type != "cuda":
            host = torch.empty_like(t, memory_format=torch.contiguous_format)
            host.copy_(t.detach())
            return _HostCopy(host, t.device, None)
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        side = self._stream
        # The copy waits for the tensor to be written, then runs beside the next layer's work;
        # record_stream keeps the allocator from reusing the tensor's memory before it is done.
        side.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(t.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        t.record_stream(side)
        return _HostCopy(host, t.device, event)
