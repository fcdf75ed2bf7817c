"""A small LatentMoE, its expert-parallel slice and the one-process reference, shared by the dispatcher tests."""
from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.host_reads import count_host_reads
from moe import GroupedAllToAllDispatcher, LatentMoE, LocalDispatcher


E, K, HIDDEN, LATENT, FFN = 8, 2, 16, 8, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def full_model() -> LatentMoE:
    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=HIDDEN, latent_size=LATENT, num_experts=E, topk=K, expert_ffn_size=FFN,
                    num_shared_experts=1, shared_ffn_size=8, init_std=0.3)
    with torch.no_grad():
        moe.router.bias.copy_(torch.randn(E) * 0.3)      # the bias changes some selections
        moe.norm.weight.uniform_(0.5, 1.5)
    return moe


def ep_model(full: LatentMoE, dispatcher) -> LatentMoE:
    """Same weights as ``full``; experts = this rank's contiguous slice of full's experts."""
    moe = LatentMoE(hidden_size=HIDDEN, latent_size=LATENT, num_experts=E, topk=K, expert_ffn_size=FFN,
                    num_shared_experts=1, shared_ffn_size=8, dispatcher=dispatcher)
    lo = dispatcher.ep_rank * dispatcher.num_local_experts
    hi = lo + dispatcher.num_local_experts
    state = {name: (t[lo:hi] if name.startswith("experts.") else t)
             for name, t in full.state_dict().items()}
    moe.load_state_dict(state)
    return moe


def keep_mask(indices: torch.Tensor, cap: int | None) -> torch.Tensor:
    """[N, k] 1.0 for kept slots: per expert, the first ``cap`` tokens in order (a plain loop,
    independent of the dispatcher's vectorised positions)."""
    keep = torch.ones(indices.shape)
    if cap is None:
        return keep
    seen = [0] * E
    for i, row in enumerate(indices.tolist()):
        for j, e in enumerate(row):
            keep[i, j] = float(seen[e] < cap)
            seen[e] += 1
    return keep


def reference(full: LatentMoE, xs: list[torch.Tensor], cap: int | None):
    """Single-process LatentMoE on each rank's tokens, dropped slots (weight 0) removed.
    Returns (outputs per rank, dropped slots per rank)."""
    outs, drops = [], []
    disp = LocalDispatcher(E)
    for x in xs:
        if x.shape[0] == 0:     # LocalDispatcher.combine cannot view 0 rows as [0, k, -1]
            outs.append(x * 0.0)
            drops.append(0)
            continue
        r = full.router(x)
        keep = keep_mask(r.indices, cap)
        drops.append(int((keep == 0).sum()))
        xs_, tpe, st = disp.dispatch(full.down(x), r.indices, r.weights * keep)
        routed = disp.combine(full.experts(xs_, tpe), st)
        outs.append(full.up(full.norm(routed)) + full.shared(x))
    return outs, drops


def check_case(group, ranks: list[int], sizes: list[int], cf: float | None,
                expect_drops: bool) -> None:
    """One model on the EP group ``group`` (global ``ranks``), rank i feeding sizes[i] tokens."""
    i = ranks.index(dist.get_rank())
    full = full_model()
    gen = torch.Generator().manual_seed(len(ranks) * 100 + sizes[0])
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in sizes]
    gs = [torch.randn(n, HIDDEN, generator=gen) for n in sizes]

    disp = GroupedAllToAllDispatcher(E, group, capacity_factor=cf)
    assert disp.ep_size == len(ranks) and disp.ep_rank == i
    moe = ep_model(full, disp)
    cap = disp.capacity(sizes[0], K) if cf is not None else None

    xr = [x.clone().requires_grad_(True) for x in xs]
    ref, drops = reference(full, xr, cap)
    sum((y * g).sum() for y, g in zip(ref, gs)).backward()
    assert (sum(drops) > 0) == expect_drops, drops

    x = xs[i].clone().requires_grad_(True)
    with count_host_reads() as host_reads:
        y = moe(x)
        (y * gs[i]).sum().backward()
    # dynamic: one read of the split sizes per layer; static: none at all.
    assert host_reads[0] == (1 if cf is None else 0), host_reads[0]
    ctx = f"ep={len(ranks)} rank={i} cf={cf}"
    torch.testing.assert_close(y, ref[i].detach(), **TOL, msg=lambda m: f"{ctx} out: {m}")
    torch.testing.assert_close(x.grad, xr[i].grad, **TOL, msg=lambda m: f"{ctx} dx: {m}")
    assert int(moe.routing.last_dropped) == drops[i], (ctx, int(moe.routing.last_dropped), drops[i])

    full_params = dict(full.named_parameters())
    lo, hi = i * disp.num_local_experts, (i + 1) * disp.num_local_experts
    for name, p in moe.named_parameters():
        want = full_params[name].grad
        grad = p.grad.clone()
        if name.startswith("experts."):
            want = want[lo:hi]
        else:
            dist.all_reduce(grad, group=group)         # as data parallel would
        torch.testing.assert_close(grad, want, **TOL, msg=lambda m: f"{ctx} {name}: {m}")
