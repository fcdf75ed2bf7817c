"""LR schedule shapes and applying them to optimizer groups."""
from __future__ import annotations

import math

import pytest
import torch

from optim import apply_lr, lr_factor


def _curve(kind, total=100, warmup=10, **kw):
    return [lr_factor(s, total, warmup, kind=kind, **kw) for s in range(total)]


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_warmup_is_linear_and_ends_at_one(kind):
    f = _curve(kind)
    assert f[0] == pytest.approx(0.1)
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[9] == 1.0


def test_cosine_decays_monotonically_to_min_ratio():
    f = _curve("cosine", min_ratio=0.1)
    tail = f[9:]
    assert all(x >= y for x, y in zip(tail, tail[1:]))
    assert f[-1] == pytest.approx(0.1)
    assert f[9 + 45] == pytest.approx(0.55, abs=1e-9)  # halfway: midpoint of [0.1, 1]
    assert lr_factor(500, 100, 10) == pytest.approx(0.1)  # past the end: hold the floor


def test_wsd_flat_then_linear_decay():
    f = _curve("wsd", min_ratio=0.1, decay_fraction=0.2)
    assert all(x == 1.0 for x in f[9:80])
    decay = f[79:]
    assert all(x > y for x, y in zip(decay, decay[1:]))
    steps = [b - a for a, b in zip(decay, decay[1:])]
    assert max(steps) - min(steps) < 1e-12  # linear
    assert f[-1] == pytest.approx(0.1)


def test_constant_and_no_warmup():
    assert _curve("constant", warmup=0) == [1.0] * 100
    assert lr_factor(0, 10, 0, kind="cosine") < 1.0 and math.isclose(
        lr_factor(9, 10, 0, kind="cosine", min_ratio=0.0), 0.0, abs_tol=1e-12)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="allowed: cosine, wsd, constant"):
        lr_factor(0, 10, 1, kind="linear")
    with pytest.raises(ValueError):
        lr_factor(0, 10, 11)
    with pytest.raises(ValueError):
        lr_factor(0, 10, 1, min_ratio=1.5)


def test_apply_lr_uses_base_lr():
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p], "lr": 1e-3}, {"params": [q], "lr": 4e-3}])
    apply_lr(opt, 0.5)
    apply_lr(opt, 0.25)  # relative to base_lr, not compounding
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2.5e-4, 1e-3])
    assert [g["base_lr"] for g in opt.param_groups] == [1e-3, 4e-3]
