"""Multi-process training runs shared by the distributed tests: train one rank, read its losses."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3train.trainer.loop import train
from tests.helpers import small_cfg


STEPS = ["train.steps=3", "train.log_interval=1", "train.eval_interval=3", "model.num_layers=8"]


def read_losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_rank(rank, world_size, run_dir, overrides):
    train(small_cfg(*STEPS, *overrides), run_dir)


def cp_share_loss(model, inputs, targets, segments, *, cp: int, cp_rank: int, cp_group) -> torch.Tensor:
    """One CP rank's loss as the trainer forms it (``_cp_slice``): ``cp`` x its share of the
    cross-entropy over the whole windows, in fp64 here (the model's own is fp32), backward run.
    inputs, targets: ``[B, S]`` whole windows; segments: their ``cu_seqlens``. Returns the
    all-reduced sum over the CP group (``cp`` x the mean loss)."""
    n = inputs.shape[1] // cp
    mine = slice(cp_rank * n, (cp_rank + 1) * n)
    logits = model(inputs[:, mine], segments=segments)
    loss = F.cross_entropy(logits.flatten(0, 1), targets[:, mine].flatten(), reduction="sum") * cp / targets.numel()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    return total
