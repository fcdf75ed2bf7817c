"""The one param-group builder: which table entries share an optimizer group, and its hyper-parameters.

Used by ``build_optimizer`` (torch optimizers) and ``ShardedOptimizer`` (ZeRO-1), so both have
the same groups in the same order, and a scheduler writing ``group["lr"] = group["base_lr"] *
factor`` treats both alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .param_table import ParamEntry

__all__ = ["OPTIMIZER_NAMES", "ParamGroupPlan", "plan_param_groups"]

OPTIMIZER_NAMES = ("adamw", "muon")


@dataclass
class ParamGroupPlan:
    """One optimizer group: its entries (table order) and the group's hyper-parameters."""

    kind: str  # "muon" or "adamw"
    lr_mult: float
    wd_mult: float
    lr: float  # base lr of the kind * lr_mult
    weight_decay: float  # weight_decay * wd_mult
    entries: list[ParamEntry] = field(default_factory=list)

    def hyper(self) -> dict[str, Any]:
        """The group dict without ``params`` (what the optimizers and their checkpoints carry)."""
        return {"lr": self.lr, "base_lr": self.lr, "weight_decay": self.weight_decay,
                "kind": self.kind, "lr_mult": self.lr_mult, "wd_mult": self.wd_mult}


def check_optimizer_name(name: str) -> None:
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZER_NAMES)}")


def plan_param_groups(table: list[ParamEntry], name: str, *, lr: float, weight_decay: float,
                      muon_lr: float | None = None) -> list[ParamGroupPlan]:
    """Groups for optimizer ``name`` over ``table``: Muon groups first, then AdamW groups.

    "adamw": every entry on AdamW. "muon": entries marked muon on Muon at ``muon_lr`` (default
    ``lr``), the rest on AdamW at ``lr``. Within a kind, one group per (lr_mult, wd_mult) in
    order of first appearance in the table (stable, so checkpoints resume into the same groups).
    """
    check_optimizer_name(name)
    if not table:
        raise ValueError("the parameter table is empty")
    groups: dict[tuple[str, float, float], ParamGroupPlan] = {}
    for kind in ("muon", "adamw"):
        base = lr if kind == "adamw" or muon_lr is None else muon_lr
        for e in table:
            if ("muon" if name == "muon" and e.optimizer == "muon" else "adamw") != kind:
                continue
            key = (kind, e.lr_mult, e.wd_mult)
            if key not in groups:
                groups[key] = ParamGroupPlan(kind, e.lr_mult, e.wd_mult, base * e.lr_mult,
                                             weight_decay * e.wd_mult)
            groups[key].entries.append(e)
    return list(groups.values())
