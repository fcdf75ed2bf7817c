"""``warm_kernels``: the optimizer's half of compile-ahead. It must launch exactly the
Newton-Schulz calls the next ``step()`` makes (same batch sizes, shapes, dtypes, head splits,
in the same order), so that the compile-only pass compiles every kernel the step needs, and it
must change nothing: parameters, gradients and optimizer state stay as they were."""
from __future__ import annotations

import copy

import pytest
import torch

import optim.muon as muon_mod
import optim.sharded as sharded_mod
from optim import build_optimizer
from optim.sharded import ShardedOptimizer
from tests.optim.helpers import EXPERT_SHAPES, HP, SHAPES, grads_for, make_table, set_grads

# Two matrices of one shape (batched together), a per-head split, a 3-D stack, a tall matrix.
WARM_SHAPES = {**SHAPES, **EXPERT_SHAPES, "mlp2.up.weight": (24, 8)}


def _recording(monkeypatch):
    """Record every muon_updates call as (n, shape, grad dtype, buf dtype, heads, ns_steps, alpha)."""
    calls, real = [], muon_mod.muon_updates

    def rec(grads, bufs, **kw):
        calls.append((len(grads), tuple(grads[0].shape), grads[0].dtype, bufs[0].dtype,
                      kw["heads"], kw["ns_steps"], kw.get("alpha")))
        return real(grads, bufs, **kw)

    monkeypatch.setattr(muon_mod, "muon_updates", rec)
    monkeypatch.setattr(sharded_mod, "muon_updates", rec)
    return calls


def _snapshot(table, opt):
    return ([e.param.detach().clone() for e in table], [e.param.grad.clone() for e in table],
            copy.deepcopy(opt.state_dict()))


def _assert_same(before, after):
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        assert torch.equal(a, b)
    assert repr(before[2]) == repr(after[2])


@pytest.mark.parametrize("kind", ["combined", "sharded"])
def test_warm_kernels_makes_the_steps_calls_and_changes_nothing(monkeypatch, kind):
    table = make_table(0, WARM_SHAPES)
    opt = (build_optimizer(table, "muon", **HP) if kind == "combined"
           else ShardedOptimizer(table, name="muon", **HP))
    calls = _recording(monkeypatch)
    for step in range(2):  # the second warm-up sees momentum state the first step created
        set_grads(table, grads_for(table, 0, step))
        before = _snapshot(table, opt)
        opt.warm_kernels()
        _assert_same(before, _snapshot(table, opt))
        warm = list(calls)
        calls.clear()
        opt.step()
        assert calls == warm
        assert any(c[4] == 4 for c in warm) and any(len(c[1]) == 3 for c in warm)  # heads, a stack
        assert any(c[0] == 2 for c in warm)  # two same-shaped matrices in one call
        calls.clear()


def test_warm_kernels_is_a_no_op_without_muon(monkeypatch):
    table = make_table(0)
    opt = build_optimizer(table, "adamw", **HP)
    calls = _recording(monkeypatch)
    set_grads(table, grads_for(table, 0, 0))
    before = _snapshot(table, opt)
    opt.warm_kernels()
    _assert_same(before, _snapshot(table, opt))
    assert calls == []
