"""GroupedAllToAllDispatcher against the single-process LatentMoE (LocalDispatcher, all experts).

Every EP rank feeds DIFFERENT tokens, so the exact statement is:
  * each rank's output (and input gradient) equals the single-process model's rows for them;
  * each rank's expert shard gradient equals the matching slice of the single-process experts'
    gradient (its experts saw every rank's tokens through the all-to-all);
  * router/down/up/norm/shared gradients summed over the EP ranks (what data parallel would
    all-reduce) equal the single-process gradient over the concatenated tokens.
fp32 throughout; tolerance rtol=atol=1e-5 (the same rows, summed in a different grouping).
With one rank the dispatcher does exactly what LocalDispatcher does: bitwise equality.

One spawned world of 4 gloo processes covers EP=4 (world group), EP=2 (two pair groups, each
its own model) and EP=1 (singleton groups, real collectives) to keep the spawn cost once.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from moe import GroupedAllToAllDispatcher, LatentMoE, LocalDispatcher
from moe.host_reads import count_host_reads
from tests.multiproc import run_multiprocess

E, K, HIDDEN, LATENT, FFN = 8, 2, 16, 8, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _full_model() -> LatentMoE:
    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=HIDDEN, latent_size=LATENT, num_experts=E, topk=K, expert_ffn_size=FFN,
                    num_shared_experts=1, shared_ffn_size=8, init_std=0.3)
    with torch.no_grad():
        moe.router.bias.copy_(torch.randn(E) * 0.3)      # the bias changes some selections
        moe.norm.weight.uniform_(0.5, 1.5)
    return moe


def _ep_model(full: LatentMoE, dispatcher) -> LatentMoE:
    """Same weights as ``full``; experts = this rank's contiguous slice of full's experts."""
    moe = LatentMoE(hidden_size=HIDDEN, latent_size=LATENT, num_experts=E, topk=K, expert_ffn_size=FFN,
                    num_shared_experts=1, shared_ffn_size=8, dispatcher=dispatcher)
    lo = dispatcher.ep_rank * dispatcher.num_local_experts
    hi = lo + dispatcher.num_local_experts
    state = {name: (t[lo:hi] if name.startswith("experts.") else t)
             for name, t in full.state_dict().items()}
    moe.load_state_dict(state)
    return moe


def _keep_mask(indices: torch.Tensor, cap: int | None) -> torch.Tensor:
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


def _reference(full: LatentMoE, xs: list[torch.Tensor], cap: int | None):
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
        keep = _keep_mask(r.indices, cap)
        drops.append(int((keep == 0).sum()))
        xs_, tpe, st = disp.dispatch(full.down(x), r.indices, r.weights * keep)
        routed = disp.combine(full.experts(xs_, tpe), st)
        outs.append(full.up(full.norm(routed)) + full.shared(x))
    return outs, drops


def _check_case(group, ranks: list[int], sizes: list[int], cf: float | None,
                expect_drops: bool) -> None:
    """One model on the EP group ``group`` (global ``ranks``), rank i feeding sizes[i] tokens."""
    i = ranks.index(dist.get_rank())
    full = _full_model()
    gen = torch.Generator().manual_seed(len(ranks) * 100 + sizes[0])
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in sizes]
    gs = [torch.randn(n, HIDDEN, generator=gen) for n in sizes]

    disp = GroupedAllToAllDispatcher(E, group, capacity_factor=cf)
    assert disp.ep_size == len(ranks) and disp.ep_rank == i
    moe = _ep_model(full, disp)
    cap = disp.capacity(sizes[0], K) if cf is not None else None

    xr = [x.clone().requires_grad_(True) for x in xs]
    ref, drops = _reference(full, xr, cap)
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


def _check_single_rank_exact(group) -> None:
    """EP=1 over a real singleton group: bitwise LocalDispatcher (output and every grad)."""
    full = _full_model()
    moe = _ep_model(full, GroupedAllToAllDispatcher(E, group))
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(5))
    outs, grads = [], []
    for model in (full, moe):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.pow(2).sum().backward()
        outs.append(y)
        grads.append([xi.grad] + [p.grad for p in model.parameters()])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _ep_job(rank: int, world: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]    # every rank joins every new_group
    singles = [dist.new_group([r]) for r in range(world)]
    pair_ranks = [0, 1] if rank < 2 else [2, 3]
    pair = pairs[rank // 2]

    with pytest.raises(ValueError, match=r"num_experts=6 .* size 4"):
        GroupedAllToAllDispatcher(6)

    # (ranks, group, uneven sizes for dynamic, equal size for static)
    layouts = [(list(range(world)), None, [5, 9, 0, 7], 6), (pair_ranks, pair, [6, 3], 7)]
    for ranks, group, uneven, n in layouts:
        _check_case(group, ranks, uneven, None, expect_drops=False)
        # c = E/k gives C = N: each token sends at most one slot per expert -> no drops.
        _check_case(group, ranks, [n] * len(ranks), E / K, expect_drops=False)
        # C = ceil(0.5 * n * k / E) = 1: most busy (rank, expert) pairs drop.
        _check_case(group, ranks, [n] * len(ranks), 0.5, expect_drops=True)
    _check_single_rank_exact(singles[rank])


@pytest.mark.slow
def test_expert_parallel_matches_single_process():
    run_multiprocess(_ep_job, 4)


@pytest.mark.parametrize("cf", [None, 0.5, 4.0], ids=["dynamic", "static-c0.5", "static-c4"])
def test_single_rank_without_distributed(cf):
    """No process group: EP=1, no collectives; dynamic is bitwise LocalDispatcher, static
    matches the masked reference."""
    assert not dist.is_initialized()
    full = _full_model()
    disp = GroupedAllToAllDispatcher(E, capacity_factor=cf)
    assert disp.num_local_experts == E and disp.mode == ("dynamic" if cf is None else "static")
    moe = _ep_model(full, disp)
    x = torch.randn(13, HIDDEN)
    cap = None if cf is None else math.ceil(cf * 13 * K / E)
    ref, drops = _reference(full, [x], cap)
    y = moe(x)
    if cf is None:
        assert torch.equal(y, full(x))
    torch.testing.assert_close(y, ref[0], **TOL)
    assert int(moe.routing.last_dropped) == drops[0]
    assert (drops[0] > 0) == (cf == 0.5)


def test_static_layout_and_padding():
    """Static mode: fixed [E_local * ep * C, d] blocks, padding rows are zeros, identity
    experts return each token times the sum of its kept weights."""
    disp = GroupedAllToAllDispatcher(4, capacity_factor=1.0)
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])       # expert 0 wanted 4 times
    w = torch.rand(4, 2)
    x = torch.randn(4, 3)
    xs, tpe, st = disp.dispatch(x, idx, w)
    cap = 2                                                   # ceil(1.0 * 4 * 2 / 4)
    assert xs.shape == (4 * cap, 3) and tpe.tolist() == [cap] * 4
    assert int(st.dropped) == 2                               # tokens 2 and 3 lose expert 0
    assert not hasattr(disp, "dropped_tokens")               # nothing stored on the dispatcher
    # Blocks of C=2 rows per expert: e0 [t0 t1], e1 [t0 t2], e2 [t1 pad], e3 [t3 pad].
    for row, token in {0: 0, 1: 1, 2: 0, 3: 2, 4: 1, 6: 3}.items():
        assert torch.equal(xs[row], x[token])
    assert not xs[5].any() and not xs[7].any()
    keep = torch.tensor([[1, 1], [1, 1], [0, 1], [1, 0]], dtype=torch.float32)
    want = x * (w * keep).sum(-1, keepdim=True)
    torch.testing.assert_close(disp.combine(xs, st), want)


def test_argument_errors():
    with pytest.raises(ValueError, match="capacity_factor"):
        GroupedAllToAllDispatcher(4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="dispatcher routes 4 experts, layer has 8"):
        LatentMoE(hidden_size=HIDDEN, latent_size=LATENT, num_experts=8, topk=K, expert_ffn_size=FFN,
                  dispatcher=GroupedAllToAllDispatcher(4))


def _ep1_dp2_keeps_every_expert(rank, world_size):
    from k3train.config import load_config
    from k3train.runtime.distributed import init_distributed
    from k3train.model.model import build_dispatcher

    init_distributed()  # DP=2, EP=1
    cfg = load_config("configs/k3_tiny.yaml", ["moe.dispatcher=grouped_a2a"])
    d = build_dispatcher(cfg)
    # With ep=1 every DP rank holds all experts; the world group would split them in two.
    assert d.ep_size == 1 and d.num_local_experts == cfg.moe.num_experts, (d.ep_size, d.num_local_experts)


@pytest.mark.slow
def test_grouped_a2a_at_ep1_keeps_every_expert_on_each_dp_rank():
    run_multiprocess(_ep1_dp2_keeps_every_expert, 2)
