"""Count host reads of tensor values (``Tensor.tolist`` / ``Tensor.item``) inside a block.

On a GPU each such read is a device synchronisation, so this counts the host syncs a dispatch
mode adds to a step; used by the dispatcher tests and the dispatch benchmark.
"""
from __future__ import annotations

import contextlib
import traceback

import torch


@contextlib.contextmanager
def count_host_reads(device_only: bool = False):
    """``with count_host_reads() as calls: ...`` then ``calls[0]`` is the number of reads and
    ``calls[1:]`` say where each was made (``file:line in function``, the innermost caller outside
    torch), so a failing "no host read" check names the line to fix.

    ``device_only``: count reads of non-CPU tensors only, the ones that synchronise a GPU (code
    that ``torch.compile`` generates reads its CPU scalar arguments with ``.item()``)."""
    calls = [0]
    orig = torch.Tensor.tolist, torch.Tensor.item

    def wrap(fn):
        def inner(self, *a, **kw):
            if device_only and self.device.type == "cpu":
                return fn(self, *a, **kw)
            calls[0] += 1
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            if frames:
                f = frames[-1]
                calls.append(f"{f.filename}:{f.lineno} in {f.name}")
            return fn(self, *a, **kw)
        return inner

    torch.Tensor.tolist, torch.Tensor.item = wrap(orig[0]), wrap(orig[1])
    try:
        yield calls
    finally:
        torch.Tensor.tolist, torch.Tensor.item = orig
