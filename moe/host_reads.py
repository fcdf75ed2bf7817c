"""Count host reads of tensor values (``Tensor.tolist`` / ``Tensor.item``) inside a block.

On a GPU each such read is a device synchronisation, so this counts the host syncs a dispatch
mode adds to a step; used by the dispatcher tests and the dispatch benchmark.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def count_host_reads():
    """``with count_host_reads() as calls: ...`` then ``calls[0]`` is the number of reads."""
    calls = [0]
    orig = torch.Tensor.tolist, torch.Tensor.item

    def wrap(fn):
        def inner(self, *a, **kw):
            calls[0] += 1
            return fn(self, *a, **kw)
        return inner

    torch.Tensor.tolist, torch.Tensor.item = wrap(orig[0]), wrap(orig[1])
    try:
        yield calls
    finally:
        torch.Tensor.tolist, torch.Tensor.item = orig
