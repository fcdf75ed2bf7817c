"""The grouped all-to-all dispatcher running the fused permutation's Triton kernels (under
Triton's CPU interpreter) at EP=2 and EP=4 on gloo, against the single-process model; and
static mode with a capacity that drops nothing against dynamic mode, outputs and every
gradient, at EP=1 (no process group), EP=2 and EP=4.

The single-process reference and its tolerances are those of tests/moe/test_dispatch_a2a.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe import GroupedAllToAllDispatcher
from tests.moe.helpers import E, HIDDEN, K, TOL, check_case, ep_model, full_model
from tests.multiproc import run_multiprocess


def _static_vs_dynamic(group, n: int, seed: int) -> None:
    """Same weights and tokens through a dynamic and a static (c = E/k: C = N, so no expert
    can overflow) dispatcher: identical outputs, input and parameter gradients, 0 dropped."""
    full = full_model()
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))
    results = []
    for cf in (None, E / K):
        moe = ep_model(full, GroupedAllToAllDispatcher(E, group, capacity_factor=cf))
        xi = x.clone().requires_grad_(True)
        y = moe(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((moe, y, xi.grad))
        assert int(moe.routing.last_dropped) == 0
    (dyn, y_dyn, dx_dyn), (sta, y_sta, dx_sta) = results
    assert sta.dispatcher.mode == "static" and dyn.dispatcher.mode == "dynamic"
    torch.testing.assert_close(y_sta, y_dyn, **TOL)
    torch.testing.assert_close(dx_sta, dx_dyn, **TOL)
    for (name, p), q in zip(sta.named_parameters(), dyn.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}: {m}")


def test_static_equals_dynamic_without_drops_at_ep1():
    assert not dist.is_initialized()
    _static_vs_dynamic(None, 13, seed=3)


def _fused_ep_job(rank: int, world: int) -> None:
    import moe.permute_fused as pf

    pf._use_triton = lambda t: True       # the interpreter runs the kernels on CPU tensors
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair_ranks = [0, 1] if rank < 2 else [2, 3]
    for ranks, group, uneven, n in [(list(range(world)), None, [5, 9, 0, 7], 6),
                                    (pair_ranks, pairs[rank // 2], [6, 3], 7)]:
        check_case(group, ranks, uneven, None, expect_drops=False)
        check_case(group, ranks, [n] * len(ranks), 0.5, expect_drops=True)
        _static_vs_dynamic(group, n, seed=rank)


@pytest.mark.slow
def test_fused_kernels_through_the_dispatcher_at_ep2_and_ep4(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # read by Triton in the spawned ranks
    run_multiprocess(_fused_ep_job, 4)


def _static_vs_dynamic_job(rank: int, world: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _static_vs_dynamic(None, 6, seed=10 + rank)               # EP=4
    _static_vs_dynamic(pairs[rank // 2], 7, seed=20 + rank)   # EP=2


@pytest.mark.slow
def test_static_equals_dynamic_without_drops_at_ep2_and_ep4():
    run_multiprocess(_static_vs_dynamic_job, 4)


@pytest.mark.parametrize("cf", [None, 1.0], ids=["dynamic", "static"])
def test_ep1_makes_no_host_read_in_either_mode(cf):
    """At EP=1 nothing is exchanged, so neither mode reads the counts on the host (a layer
    step can be captured in a CUDA graph); the experts get the same rows as LocalDispatcher's
    (dynamic) or fixed blocks of C rows (static)."""
    from benchmarks.host_reads import count_host_reads

    full = full_model()
    moe = ep_model(full, GroupedAllToAllDispatcher(E, capacity_factor=cf))
    x = torch.randn(10, HIDDEN, requires_grad=True)
    with count_host_reads() as reads:
        moe(x).sum().backward()
    assert reads[0] == 0
    if cf is None:
        assert torch.equal(moe.routing.last_tokens_per_expert,
                           torch.bincount(moe.routing.last.indices.reshape(-1), minlength=E))


def test_capacity_factor_selects_the_static_dispatcher():
    from k3train.config import load_config
    from k3train.model.model import build_dispatcher

    d = build_dispatcher(load_config("configs/k3_tiny.yaml", ["moe.capacity_factor=1.5"]))
    assert isinstance(d, GroupedAllToAllDispatcher) and d.mode == "static" and d.capacity_factor == 1.5
    # (local with a capacity factor is refused when the config loads: tests/config/test_config.py)
