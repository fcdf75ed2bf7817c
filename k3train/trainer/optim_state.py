"""Optimizer state per parameter, whatever the optimizer keeps it as: the form checkpoints store.

Per parameter (a tensor of this rank's model part) the state is a dict of tensors of the
parameter's own shape: AdamW's ``exp_avg`` / ``exp_avg_sq``, Muon's ``momentum_buffer``; plus one
update count for the whole optimizer (AdamW's bias correction). The replicated
``CombinedOptimizer`` keeps exactly that; ZeRO-1's ``ShardedOptimizer`` keeps flat AdamW shards
and owner-only Muon momenta, which ``per_param_state`` gathers back into whole parameters
(collective over its data-parallel groups) and ``load_per_param_state`` slices out again. So a
state saved with or without ZeRO-1, at any data-parallel size, loads into either.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from optim import ShardedOptimizer

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _sharded_per_param(opt: ShardedOptimizer) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for d in opt.domains:
        for b in d.buckets:
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                shard = getattr(b, key)
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
            buf = d.momentum[e.name] if owner == d.rank else torch.empty_like(e.param)
            if d.world > 1:
                dist.broadcast(buf, group_src=owner, group=d.group)
            out.setdefault(id(e.param), {})["momentum_buffer"] = buf.clone()
    return out, opt._step


def per_param_state(opt) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
    """({id(param): {state key: tensor shaped like param}}, update count). Collective for ZeRO-1."""
    if isinstance(opt, ShardedOptimizer):
        return _sharded_per_param(opt)
    out, step = {}, 0
    for inner in opt.optimizers:
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p, {})
                if "step" in st:
                    step = max(step, int(st["step"]))
                moments = {k: v.detach().clone() for k, v in st.items() if k in _MOMENT_KEYS}
                if moments:
                    out[id(p)] = moments
    return out, step


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
                            getattr(b, key)[s.lo:s.hi].copy_(flat)
            for e, _ in d.owned_muon():
                if "momentum_buffer" in state.get(id(e.param), {}):
                    d.momentum[e.name].copy_(state[id(e.param)]["momentum_buffer"])
        opt._step = step
        return
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
                new = {k: st[k].to(p.device).clone() for k in keys if k in st}
                if adam and len(new) == 2:
                    new["step"] = torch.tensor(float(step), device=p.device if on_device else "cpu")
                    inner.state[p] = new
                elif not adam and new:
                    inner.state[p] = new
