"""Optimizers for k3train: Muon (per-head), AdamW grouping by a parameter table, LR schedules,
a data-parallel sharded (ZeRO-1) step, low-precision (bf16) weights with fp32 main parameters
and gradients (``optim.main_params``, ``optim.main_grads``), and the one gradient path (reduction, norm, clip) both
the replicated and the sharded optimizer use (``optim.grads``).

Depends on torch (and megatron-core) only, never on ``k3train``.
"""
from .adamw_state import NarrowStateAdamW
from .build import OPTIMIZER_NAMES, CombinedOptimizer, build_optimizer
from .grads import DataParallelGrads, GradGroups, clip_grads_, global_grad_norm
from .main_grads import MainGrads
from .main_params import MainParamOptimizer, cast_params_
from .muon import (
    NS_COEFFICIENTS,
    Muon,
    apply_muon_updates,
    muon_scale,
    muon_update,
    muon_updates,
    newton_schulz,
)
from .muon_distributed import DistributedMuon, ns_flops_per_rank, plan_ns_owners
from .param_groups import ParamGroupPlan, plan_param_groups
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
    "DataParallelGrads", "GradGroups", "clip_grads_", "global_grad_norm",
    "MainGrads", "MainParamOptimizer", "NarrowStateAdamW", "cast_params_",
    "ParamGroupPlan", "plan_param_groups",
    "NS_COEFFICIENTS", "Muon", "apply_muon_updates", "muon_scale", "muon_update", "muon_updates",
    "newton_schulz", "DistributedMuon", "ns_flops_per_rank", "plan_ns_owners",
    "OPTIMIZERS", "ParamEntry", "ParamRule", "build_param_table", "format_table",
    "SCHEDULES", "apply_lr", "lr_factor",
    "ShardedOptimizer", "plan_muon_owners",
]
