"""Dispatch gathers, the weighted combine and the autocast-aware RMSNorm against plain torch."""
from __future__ import annotations

import pytest
import torch

from moe.norm import RMSNorm
from moe.permute import permute_rows, repeat_rows, weighted_sum


def _grads(fn, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


def test_permute_rows_matches_index_select_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 5, dtype=torch.float64, generator=g)
    perm = torch.randperm(37, generator=g)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(37)
    dy = torch.randn(37, 5, dtype=torch.float64, generator=g)
    y, dx = _grads(lambda t: permute_rows(t, perm, inverse), x, dy)
    y_ref, dx_ref = _grads(lambda t: t.index_select(0, perm), x, dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, dx_ref)  # a permutation: each row's gradient is one copied row


@pytest.mark.parametrize("k", [1, 2, 4])
def test_repeat_rows_matches_index_select_of_repeated_tokens(k):
    g = torch.Generator().manual_seed(k)
    n, d = 23, 6
    x = torch.randn(n, d, dtype=torch.float64, generator=g)
    experts = torch.randint(0, 5, (n * k,), generator=g)
    order = torch.argsort(experts, stable=True)
    row_of_slot = torch.empty_like(order)
    row_of_slot[order] = torch.arange(n * k)
    dy = torch.randn(n * k, d, dtype=torch.float64, generator=g)
    y, dx = _grads(lambda t: repeat_rows(t, order, row_of_slot, k), x, dy)
    y_ref, dx_ref = _grads(lambda t: t.index_select(0, order // k), x, dy)
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)


def test_weighted_sum_matches_per_token_loop():
    g = torch.Generator().manual_seed(3)
    n, k, d = 9, 3, 4
    y = torch.randn(n * k, d, generator=g).to(torch.bfloat16)
    w = torch.rand(n, k, generator=g)
    out = weighted_sum(y, w)
    assert out.dtype == torch.bfloat16
    for i in range(n):
        ref = sum(w[i, j].double() * y[i * k + j].double() for j in range(k))
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-2, atol=1e-2)


def test_rms_norm_emits_the_autocast_dtype_once():
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
    x = torch.randn(3, 5, 16, generator=g)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    out = norm(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16
    # Under autocast the consumer GEMMs run in bf16: the norm hands them bf16, rounded once
    # from the fp32 result (exactly what autocast would have cast per GEMM).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ac = norm(x)
    assert out_ac.dtype == torch.bfloat16
    assert torch.equal(out_ac, out.detach().to(torch.bfloat16))
