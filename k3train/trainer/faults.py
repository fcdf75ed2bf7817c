"""Fault injection for reliability tests, driven by the ``K3TRAIN_FAULTS`` environment variable.

Comma-separated ``kind@step`` items; unset in normal runs (then every hook is a dict lookup):
* ``nan@N``   : the loss of step N becomes NaN (the step must be skipped, not applied);
* ``crash@N`` : the process exits with status 13 at the start of step N, on the first attempt
  only (``TORCHELASTIC_RESTART_COUNT`` is 0), as a dying worker under ``torchrun --max-restarts``;
* ``slow_save@N``: saving step N's checkpoint pauses 30 s after writing the rank files and
  before the rename, so a test can kill the process mid-save.
"""
from __future__ import annotations

import os
import time


def _parse() -> dict[str, set[int]]:
    faults: dict[str, set[int]] = {}
    for item in filter(None, os.environ.get("K3TRAIN_FAULTS", "").split(",")):
        kind, _, step = item.partition("@")
        if kind not in ("nan", "crash", "slow_save") or not step.isdigit():
            raise ValueError(f"K3TRAIN_FAULTS item '{item}' is not one of nan@N, crash@N, slow_save@N")
        faults.setdefault(kind, set()).add(int(step))
    return faults


def active(kind: str, step: int) -> bool:
    return step in _parse().get(kind, ())


def maybe_crash(step: int) -> None:
    if active("crash", step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        print(f"[k3train] K3TRAIN_FAULTS: crashing at step {step}", flush=True)
        os._exit(13)


def maybe_slow_save(step: int) -> None:
    if active("slow_save", step):
        print(f"[k3train] K3TRAIN_FAULTS: pausing inside the save of step {step}", flush=True)
        time.sleep(30)
