"""The K3 parameter table: which optimizer, lr and weight-decay multiplier each parameter gets.

Muon takes the 2-D hidden matrices (projections, output gates, dense FFN, MoE latent down/up
and shared experts). KDA q/k/v and MLA q/kv up-projections are orthogonalised per head (K3).
AdamW takes embeddings, head, norms, AttnRes queries, the router, conv filters, A_log, dt_bias
and the beta / forget-gate projections (small gate parameters whose scale matters more than
their direction). Routed-expert weights are 3-D ``[E, in, out]``: Muon treats each as E
matrices, each expert orthogonalised on its own. Norm-like parameters get no weight decay.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn as nn

from k3train.config.schema import OptimConfig
from k3train.model.kda_layer import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from optim import (GradGroups, ParamRule, ShardedOptimizer, build_optimizer, build_param_table,
                   format_table)

_NO_DECAY = r"(norm|\.query$|A_log|dt_bias|bias$|o_norm_weight)"
_ADAMW = r"(embed\.|head\.|router\.|_conv$|\.b_proj\.|\.f_down\.|\.f_up\.|\.f_head\.)"
_EXPERTS = r"\.experts\.w_(gate|up|down)$"


def k3_param_rules(model: nn.Module, per_head: bool) -> list[ParamRule]:
    rules = [ParamRule(_NO_DECAY, "adamw", wd_mult=0.0), ParamRule(_ADAMW, "adamw"),
             ParamRule(_EXPERTS, "muon")]
    if per_head:
        for name, mod in model.named_modules():
            prefix = re.escape(name)
            if isinstance(mod, KimiDeltaAttention):
                rules.append(ParamRule(rf"^{prefix}\.(q|k|v)_proj\.", "muon", heads=mod.num_heads))
            elif isinstance(mod, GatedMLA):
                rules.append(ParamRule(rf"^{prefix}\.(q_up|kv_up)\.", "muon", heads=mod.num_heads))
    return rules


def build_k3_optimizer(model: nn.Module, cfg: OptimConfig, *, zero1_groups: GradGroups | None = None,
                       expert_params: Iterable[torch.Tensor] = ()):
    """Returns (optimizer, table text for the run log).

    zero1_groups: None for a replicated optimizer (gradients reduced by
    ``optim.DataParallelGrads``), or the process groups of a ZeRO-1 ``ShardedOptimizer``, which
    reduces them itself; ``expert_params`` (the routed-expert weights) are then sharded over
    ``zero1_groups.expert_dp``.
    """
    table = build_param_table(model.named_parameters(), k3_param_rules(model, cfg.muon_per_head))
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if zero1_groups is None:
        return build_optimizer(table, cfg.name, **kwargs), format_table(table)
    expert_ids = {id(p) for p in expert_params}
    expert_names = {e.name for e in table if id(e.param) in expert_ids}
    opt = ShardedOptimizer(table, name=cfg.name, groups=zero1_groups,
                           is_expert=expert_names.__contains__, **kwargs)
    return opt, format_table(table)
