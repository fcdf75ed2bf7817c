"""Helpers for tests that run ``k3train train`` as a subprocess (signals, kills, locks)."""
from __future__ import annotations

import os
import sys
import time

from tests.helpers import SMALL

CLI = [sys.executable, "-m", "k3train", "train", "--config", "configs/k3_tiny.yaml", *SMALL]


def cli_env(**extra) -> dict:
    """The test process's environment for a child run: one thread, no wandb, no inherited
    fault injection; ``extra`` on top."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("K3TRAIN_FAULTS", None)
    env.update(extra)
    return env


def wait_for(predicate, timeout: float = 120.0) -> bool:
    """Poll ``predicate`` every 0.2 s until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False
