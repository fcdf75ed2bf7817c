"""Optimizers for k3train: Muon (per-head), AdamW grouping by a parameter table, LR schedules,
and a data-parallel sharded (ZeRO-1) step.

Depends on torch (and megatron-core) only, never on ``k3train``.
"""
from .build import OPTIMIZER_NAMES, CombinedOptimizer, build_optimizer
from .muon import (
    NS_COEFFICIENTS,
    Muon,
    apply_muon_updates,
    muon_scale,
    muon_update,
    muon_updates,
    newton_schulz,
)
from .param_table import (
    OPTIMIZERS,
    ParamEntry,
    ParamRule,
    build_param_table,
    format_table,
)
from .schedule import SCHEDULES, apply_lr, lr_factor
from .sharded import ShardedOptimizer, plan_muon_owners

__all__ = [
    "OPTIMIZER_NAMES", "CombinedOptimizer", "build_optimizer",
    "NS_COEFFICIENTS", "Muon", "apply_muon_updates", "muon_scale", "muon_update", "muon_updates",
    "newton_schulz",
    "OPTIMIZERS", "ParamEntry", "ParamRule", "build_param_table", "format_table",
    "SCHEDULES", "apply_lr", "lr_factor",
    "ShardedOptimizer", "plan_muon_owners",
]
