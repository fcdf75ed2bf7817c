"""Optimizer state per parameter, whatever the optimizer keeps it as: the form checkpoints store.

Per parameter (a tensor of this rank's model part) the state is a dict of tensors of the
parameter's own shape: AdamW's ``exp_avg`` / ``exp_avg_sq``, Muon's ``momentum_buffer``; plus one
update count for the whole optimizer (AdamW's bias correction). The replicated
``CombinedOptimizer`` keeps exactly that; ZeRO-1's ``ShardedOptimizer`` keeps flat AdamW shards
and owner-only Muon momenta, which ``per_param_state`` gathers back into whole parameters
(collective over its data-parallel groups) and ``load_per_param_state`` slices out again. So a
state saved with or without ZeRO-1, at any data-parallel size, loads into either.

Moments kept in bf16 (``optim.state_dtype=bf16``) are handed out as fp32 (exactly: every bf16
value is an fp32 value) and narrowed again on loading, so a checkpoint's moments load under
either state dtype. With low-precision weights (``precision.param_dtype=bf16``) the optimizer
holds fp32 main parameters: ``main_param_values`` gathers them whole, keyed like the moments,
for the checkpoint to store under the weights' own names, and ``load_main_param_values`` sets
them (and the rounded weights) from a checkpoint's tensors.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from optim import MainParamOptimizer, ShardedOptimizer

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A moment as checkpoints store it: bf16 widened to fp32 (exact), other dtypes as they are."""
    return t.float() if t.dtype == torch.bfloat16 else t


def _sharded_per_param(opt: ShardedOptimizer) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for d in opt.domains:
        for b in d.buckets:
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                shard = _wide(getattr(b, key))
                if d.world > 1:
                    full = torch.empty(b.shard * d.world, dtype=shard.dtype, device=shard.device)
                    dist.all_gather_into_tensor(full, shard.contiguous(), group=d.group)
                else:
                    full = shard
                moments[key] = full
            off = 0
            for p in b.params:
                out.setdefault(id(p), {}).update(
                    {k: v[off:off + p.numel()].view_as(p).clone() for k, v in moments.items()})
                off += p.numel()
        for e, _, owner in d.muon:
            buf = (d.momentum[e.name] if owner == d.rank else
                   torch.empty(e.param.shape, dtype=opt.momentum_dtype(e.param), device=e.param.device))
            if d.world > 1:
                dist.broadcast(buf, group_src=owner, group=d.group)
            out.setdefault(id(e.param), {})["momentum_buffer"] = _wide(buf).clone()
    return out, opt._step


def per_param_state(opt) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
    """({id(param): {state key: tensor shaped like param}}, update count). Collective for ZeRO-1."""
    if isinstance(opt, ShardedOptimizer):
        return _sharded_per_param(opt)
    model_id = _model_id(opt)
    out, step = {}, 0
    for inner in opt.optimizers:
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p, {})
                if "step" in st:
                    step = max(step, int(st["step"]))
                moments = {k: _wide(v.detach()).clone() for k, v in st.items() if k in _MOMENT_KEYS}
                if moments:
                    out[model_id(p)] = moments
    return out, step


def _model_id(opt):
    """id of the model parameter an inner optimizer's tensor stands for (a main parameter's
    weight under ``MainParamOptimizer``, else the tensor itself)."""
    if isinstance(opt, MainParamOptimizer):
        return lambda t: id(opt.model_param(t))
    return id


def param_kinds(opt) -> dict[int, str]:
    """{id(model parameter): "adamw" or "muon"}: the optimizer kind each parameter's group has."""
    model_id = _model_id(opt)
    return {model_id(p): group["kind"] for group in opt.param_groups for p in group["params"]}


def main_param_values(opt) -> dict[int, torch.Tensor]:
    """{id(model parameter): its fp32 main parameter, whole ``[*p.shape]``} where the optimizer
    keeps main parameters (low-precision weights), else {}. Collective for ZeRO-1 (each rank
    holds the main parameters of its shards and Muon matrices: gathered / broadcast)."""
    # The live tensors or views of one gathered buffer, not copies: a checkpoint copies them to
    # the host (``rank_state``), and a second device copy of 4 bytes per parameter is not needed.
    if isinstance(opt, MainParamOptimizer):
        return {k: v.detach() for k, v in opt.main_params().items()}
    if not (isinstance(opt, ShardedOptimizer) and opt.main):
        return {}
    out: dict[int, torch.Tensor] = {}
    for d in opt.domains:
        for b in d.buckets:
            full = b.main
            if d.world > 1:
                full = torch.empty(b.shard * d.world, dtype=b.main.dtype, device=b.main.device)
                dist.all_gather_into_tensor(full, b.main.contiguous(), group=d.group)
            off = 0
            for p in b.params:
                out[id(p)] = full[off:off + p.numel()].view(p.shape)
                off += p.numel()
        for e, _, owner in d.muon:
            main = (d.mains[e.name] if owner == d.rank else
                    torch.empty(e.param.shape, dtype=torch.float32, device=e.param.device))
            if d.world > 1:
                dist.broadcast(main, group_src=owner, group=d.group)
            out[id(e.param)] = main
    return out


def load_main_param_values(opt, values: dict[int, torch.Tensor]) -> None:
    """Set the optimizer's fp32 main parameters (and the rounded weights) from whole values
    ``{id(model parameter): tensor [*p.shape]}`` (a checkpoint's tensors, read at full
    precision); nothing where the optimizer keeps none. Not collective."""
    if isinstance(opt, MainParamOptimizer) or (isinstance(opt, ShardedOptimizer) and opt.main):
        opt.load_main_params({k: v.to(torch.float32) for k, v in values.items()})


def load_per_param_state(opt, state: dict[int, dict[str, torch.Tensor]], step: int) -> None:
    """Set ``opt``'s state from ``per_param_state``'s form; parameters without an entry keep a
    fresh state (a Muon parameter saved under AdamW, say, starts its momentum at zero)."""
    if isinstance(opt, ShardedOptimizer):
        for d in opt.domains:
            for b in d.buckets:
                for s in b.segments:
                    st = state.get(id(s.param), {})
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in st:
                            flat = st[key].reshape(-1)[s.plo:s.plo + s.hi - s.lo]
                            getattr(b, key)[s.lo:s.hi].copy_(flat)  # narrowed to the state dtype
            for e, _ in d.owned_muon():
                if "momentum_buffer" in state.get(id(e.param), {}):
                    d.momentum[e.name].copy_(state[id(e.param)]["momentum_buffer"])
        opt._step = step
        return
    if isinstance(opt, MainParamOptimizer):  # the inner optimizer's state is on the main parameters
        state = {id(m): state[pid] for pid, m in opt.main_params().items() if pid in state}
    for inner in opt.optimizers:
        adam = isinstance(inner, torch.optim.AdamW)
        # torch keeps AdamW's step on the parameter's device for its fused kernel, else on the host.
        on_device = adam and bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
        for group in inner.param_groups:
            for p in group["params"]:
                st = state.get(id(p))
                if not st:
                    continue
                keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)
                # The optimizer's state dtype (bf16 moments), else the parameter's.
                dtype = getattr(inner, "state_dtype", None) if adam else group.get("state_dtype")
                new = {k: st[k].to(device=p.device, dtype=dtype or p.dtype, copy=True) for k in keys if k in st}
                if adam and len(new) == 2:
                    new["step"] = torch.tensor(float(step), device=p.device if on_device else "cpu")
                    inner.state[p] = new
                elif not adam and new:
                    inner.state[p] = new
