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

from k3train.config.schema import OptimConfig, PrecisionConfig
from k3train.model.kda_layer import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from optim import (GradGroups, MainParamOptimizer, ParamRule, ShardedOptimizer, build_optimizer,
                   build_param_table, format_table, ns_flops_per_rank)
from optim.muon import tp_split_dim

_NO_DECAY = r"(norm|\.query$|A_log|dt_bias|bias$|o_norm_weight)"
_ADAMW = r"(embed\.|head\.|router\.|_conv$|\.b_proj\.|\.f_down\.|\.f_up\.|\.f_head\.)"
_EXPERTS = r"\.experts\.w_(gate|up|down)$"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def build_k3_optimizer(model: nn.Module, cfg: OptimConfig, *, groups: GradGroups = GradGroups(),
                       expert_params: Iterable[torch.Tensor] = (),
                       precision: PrecisionConfig = PrecisionConfig()):
    """Returns (optimizer, table text for the run log).

    ``precision.param_dtype=bf16``: the model's weights are cast to bf16 here (after their fp32
    values became the optimizer's fp32 main parameters) and their gradients accumulate in fp32
    ``main_grad`` (``optim.main_params``; docs/memory.md#layouts): a ``MainParamOptimizer``
    (replicated) or a ``ShardedOptimizer`` with ``param_dtype`` (ZeRO-1), both of which reduce
    gradients themselves (``reduces_gradients``). ``cfg.state_dtype``: the moments' dtype.

    groups: the run's process groups (default: one rank). ``cfg.zero1``: a ZeRO-1
    ``ShardedOptimizer``, which reduces gradients itself, with ``expert_params`` (the
    routed-expert weights) sharded over ``groups.expert_dp``. Otherwise a replicated optimizer
    (gradients reduced by ``optim.DataParallelGrads``) whose Muon, with
    ``cfg.muon_distributed``, runs Newton-Schulz once per matrix block per ``groups.dp``
    (dense) or ``groups.expert_dp`` (``expert_params``).

    Every form orthogonalises a tensor-parallel weight whole (``groups.tp``: its Newton-Schulz
    inputs all-gathered over TP, each rank keeping its slice; docs/optim_sharding.md), so
    ``parallel.tp=2`` steps as ``tp=1`` does.
    """
    table = build_param_table(model.named_parameters(), k3_param_rules(model, cfg.muon_per_head))
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                  ns_mode=cfg.muon_ns)
    # None: each optimizer's default (fp32 moments, or the weights' dtype), the path unchanged.
    state_dtype = None if cfg.state_dtype == "fp32" else _DTYPES[cfg.state_dtype]
    param_dtype = None if precision.param_dtype == "fp32" else _DTYPES[precision.param_dtype]
    expert_params = list(expert_params)
    expert_ids = {id(p) for p in expert_params}
    if not cfg.zero1:
        group_of = None
        if cfg.muon_distributed:
            def group_of(p: torch.Tensor):
                return groups.expert_dp if id(p) in expert_ids else groups.dp
        if param_dtype is not None:
            opt = MainParamOptimizer(table, param_dtype=param_dtype, name=cfg.name, groups=groups,
                                     expert_params=expert_params, state_dtype=state_dtype,
                                     muon_group_of=group_of, muon_tp_group=groups.tp, **kwargs)
            return opt, format_table(table)
        opt = build_optimizer(table, cfg.name, muon_group_of=group_of, muon_tp_group=groups.tp,
                              state_dtype=state_dtype, **kwargs)
        return opt, format_table(table)
    expert_names = {e.name for e in table if id(e.param) in expert_ids}
    opt = ShardedOptimizer(table, name=cfg.name, groups=groups, is_expert=expert_names.__contains__,
                           param_dtype=param_dtype, state_dtype=state_dtype, **kwargs)
    return opt, format_table(table)


def muon_ns_flops_per_rank(model: nn.Module, cfg: OptimConfig, *, dp: int, ep: int = 1, tp: int = 1,
                           distributed: bool = True, steps: int = 5) -> list[int]:
    """Newton-Schulz FLOPs per step on each of ``dp`` data-parallel ranks for ``model`` (one
    rank's parameters: its expert shard at ``ep``) under ``cfg``'s Muon table: every rank all of
    them (replicated), or its owned blocks (``cfg.muon_distributed``'s plan: dense blocks over
    DP, routed-expert blocks over the ``dp / ep`` expert-DP copies; rank ``r`` is expert-DP rank
    ``r // ep``, megatron-core's layout). 0 for every rank when the optimizer is not Muon.
    ``tp``: the TP size ``model`` was built at; a matrix whose blocks straddle its TP shards
    counts whole (each TP rank orthogonalises it whole: ``optim.muon.tp_shard``)."""
    if cfg.name != "muon":
        return [0] * dp
    if dp % ep:
        raise ValueError(f"dp={dp} is not a multiple of ep={ep}")
    table = [e for e in build_param_table(model.named_parameters(), k3_param_rules(model, cfg.muon_per_head))
             if e.optimizer == "muon"]
    expert = [bool(re.search(_EXPERTS, e.name)) for e in table]
    shapes = [_whole_shape(e.param, e.heads, tp) for e in table]
    dense = ns_flops_per_rank([(s, e.heads) for s, e, x in zip(shapes, table, expert) if not x], dp,
                              steps=steps, distributed=distributed)
    experts = ns_flops_per_rank([(s, e.heads) for s, e, x in zip(shapes, table, expert) if x], dp // ep,
                                steps=steps, distributed=distributed)
    return [dense[r] + experts[r // ep] for r in range(dp)]


def _whole_shape(p: torch.Tensor, heads: int | None, tp: int) -> tuple[int, ...]:
    """The shape Muon orthogonalises ``p`` (a TP shard) at: whole along a split its blocks straddle."""
    shape = list(p.shape)
    dim = tp_split_dim(p, heads) if tp > 1 else None
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)
