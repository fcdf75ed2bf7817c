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

from moe import GroupedAllToAllDispatcher, LatentMoE
from tests.multiproc import run_multiprocess
from tests.moe.helpers import E, FFN, HIDDEN, K, LATENT, TOL, check_case, ep_model, full_model, reference



def _check_single_rank_exact(group) -> None:
    """EP=1 over a real singleton group: bitwise LocalDispatcher (output and every grad)."""
    full = full_model()
    moe = ep_model(full, GroupedAllToAllDispatcher(E, group))
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
        check_case(group, ranks, uneven, None, expect_drops=False)
        # c = E/k gives C = N: each token sends at most one slot per expert -> no drops.
        check_case(group, ranks, [n] * len(ranks), E / K, expect_drops=False)
        # C = ceil(0.5 * n * k / E) = 1: most busy (rank, expert) pairs drop.
        check_case(group, ranks, [n] * len(ranks), 0.5, expect_drops=True)
    _check_single_rank_exact(singles[rank])


@pytest.mark.slow
def test_expert_parallel_matches_single_process():
    run_multiprocess(_ep_job, 4)


@pytest.mark.parametrize("cf", [None, 0.5, 4.0], ids=["dynamic", "static-c0.5", "static-c4"])
def test_single_rank_without_distributed(cf):
    """No process group: EP=1, no collectives; dynamic is bitwise LocalDispatcher, static
    matches the masked reference."""
    assert not dist.is_initialized()
    full = full_model()
    disp = GroupedAllToAllDispatcher(E, capacity_factor=cf)
    assert disp.num_local_experts == E and disp.mode == ("dynamic" if cf is None else "static")
    moe = ep_model(full, disp)
    x = torch.randn(13, HIDDEN)
    cap = None if cf is None else math.ceil(cf * 13 * K / E)
    ref, drops = reference(full, [x], cap)
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
