"""Mixture-of-experts library: router, balancing, dispatchers, grouped experts, LatentMoE.

Depends only on torch and megatron-core (never on k3train).
"""
from .activations import situ, situ_glu
from .balancing import (BALANCER_NAMES, Balancer, aux_free_update, quantile_balance,
                        quantile_balance_distributed, switch_aux_loss)
from .dispatch import LocalDispatcher, TokenDispatcher
from .dispatch_a2a import GroupedAllToAllDispatcher, all_to_all_rows
from .experts import GroupedExperts, SiTUGLUMLP, grouped_mm_supported
from .layer import LatentMoE, RMSNorm
from .metrics import LoadTracker, expert_load, max_vio
from .router import RouterOutput, SigmoidTopKRouter
from .routing_record import RoutingRecord

__all__ = [
    "BALANCER_NAMES", "Balancer", "GroupedAllToAllDispatcher", "GroupedExperts", "LatentMoE",
    "LoadTracker", "LocalDispatcher", "RMSNorm", "RouterOutput", "RoutingRecord", "SiTUGLUMLP",
    "SigmoidTopKRouter", "TokenDispatcher", "all_to_all_rows", "aux_free_update",
    "expert_load", "grouped_mm_supported", "max_vio", "quantile_balance",
    "quantile_balance_distributed", "situ", "situ_glu", "switch_aux_loss",
]
