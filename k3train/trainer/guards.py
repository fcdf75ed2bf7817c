"""The non-finite guards around saves and stops: never write a checkpoint that holds inf/NaN
parameters, and name only checkpoints that exist when a run stops itself."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from k3train.errors import CheckpointError
from k3train.trainer.checkpoint import latest_checkpoint


def params_finite(params: list[torch.Tensor], device: torch.device) -> bool:
    """Whether every parameter of every rank is finite (a collective over the world when there
    is more than one rank, so all ranks decide alike before the collective save). The step's
    own check covers the loss and gradients only: an update can still overflow the weights."""
    ok = torch.stack([p.detach().isfinite().all() for p in params]).all() if params else torch.tensor(True)
    flag = ok.to(device=device, dtype=torch.float32).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def last_checkpoint_note(ckpt_dir: Path, interval: int) -> str:
    """One sentence naming the checkpoint a stopped run can resume from, or saying there is none."""
    try:
        path = latest_checkpoint(ckpt_dir)
    except CheckpointError:
        path = None
    if path is not None:
        return f"The last checkpoint is {path}; resume from it with --resume."
    why = ("checkpoint.interval=0 saves only at the end of the run" if interval == 0
           else f"the first save was due at step {interval}")
    return f"No checkpoint was saved ({why})."
