"""Process groups for a command that runs in one process (eval, generate, export, import,
model-info): made when none exist, torn down on the way out; left alone under torchrun or
inside a caller that made them."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from k3train.runtime.distributed import ParallelInfo, groups_initialized, init_distributed, shutdown_distributed


@contextlib.contextmanager
def process_groups(tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, device: str = "cpu", *,
                   reuse_existing: bool = False) -> Iterator[ParallelInfo | None]:
    """``init_distributed`` (this layout) for the body; a world this context made is shut down
    after it, one the caller made (torchrun, a test harness) is left. reuse_existing: when
    the model-parallel groups already exist, use them as they are and yield None (building a model on
    the meta device needs some groups, not a layout)."""
    owned = not dist.is_initialized()
    if reuse_existing and groups_initialized():
        yield None
        return
    info = init_distributed(tp, pp, vpp, ep, device)
    try:
        yield info
    finally:
        if owned:
            shutdown_distributed()
