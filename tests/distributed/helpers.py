"""Multi-process training runs shared by the distributed tests: train one rank, read its losses."""
from __future__ import annotations

import json

from k3train.trainer.loop import train
from tests.helpers import small_cfg


STEPS = ["train.steps=3", "train.log_interval=1", "train.eval_interval=3", "model.num_layers=8"]


def read_losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_rank(rank, world_size, run_dir, overrides):
    train(small_cfg(*STEPS, *overrides), run_dir)
