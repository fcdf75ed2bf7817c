"""Learning-rate schedules as a multiplicative factor on each group's ``base_lr``.

``step`` is 0-based and counts the optimizer step about to be taken, so with ``total_steps``
steps the last one is ``total_steps - 1``. Warmup is linear, ``(step + 1) / warmup_steps``:
the first step already moves (no wasted step at lr 0) and step ``warmup_steps - 1`` is at 1.0.
Decays are timed so the last step lands exactly on ``min_ratio``.
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["SCHEDULES", "lr_factor", "apply_lr"]

SCHEDULES = ("cosine", "wsd", "constant")


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    kind: str = "cosine",
    min_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """LR multiplier for ``step`` in ``[0, total_steps)`` (later steps hold the final value).

    * ``constant``: warmup, then 1.
    * ``cosine``: warmup, then half a cosine from 1 down to ``min_ratio``.
    * ``wsd`` (warmup-stable-decay): warmup, flat at 1, then a linear decay to ``min_ratio``
      over the last ``decay_fraction`` of all steps (never starting before warmup ends).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; allowed: {', '.join(SCHEDULES)}")
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need total_steps >= 1 and 0 <= warmup_steps <= total_steps, "
                         f"got total_steps={total_steps}, warmup_steps={warmup_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}")

    done = min(step + 1, total_steps)  # steps completed once this one is taken
    if done <= warmup_steps:
        return done / warmup_steps
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        progress = (done - warmup_steps) / (total_steps - warmup_steps)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = max(1, round(decay_fraction * total_steps))
    decay_start = max(total_steps - decay_steps, warmup_steps)
    if done <= decay_start:
        return 1.0
    progress = (done - decay_start) / (total_steps - decay_start)
    return 1.0 - (1.0 - min_ratio) * progress


def apply_lr(optimizer: Any, factor: float) -> None:
    """Set every group's ``lr = base_lr * factor``.

    ``optimizer`` is anything with ``param_groups`` (a ``CombinedOptimizer`` or a plain torch
    optimizer). A group without ``base_lr`` gets its current lr recorded as ``base_lr`` on the
    first call, so plain torch optimizers work too.
    """
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("base_lr", group["lr"]) * factor
