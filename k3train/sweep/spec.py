"""What an ablation file declares: its variants (one run each) and the sweep around them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Variant:
    name: str
    overrides: list[str]
    group: str | None = None  # the variant a seeded copy belongs to (None without seeds)
    seed: int | None = None


@dataclass
class Sweep:
    name: str
    base: Path
    overrides: list[str]
    variants: list[Variant] = field(default_factory=list)
    seeds: list[int] | None = None
    tune: str | None = None
    tune_metric: str = "final_val_loss"
