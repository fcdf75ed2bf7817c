"""fla's graph-mode KDA backward (``use_graph``) returns some gradients in process-wide static
buffers that its next backward rewrites (fla/ops/utils/graph.py). ``fla_kda_varlen`` must hand
autograd gradients of its own: checked with a stand-in for fla's ``chunk_kda`` that does exactly
that (one static buffer for every call's input gradients), against the gradients each call
should have (2 * its upstream gradient), after a second call has rewritten the buffer."""
from __future__ import annotations

import torch

from k3train.ops.kda import fla_kda_varlen

STATIC: dict[str, torch.Tensor] = {}


class _StaticGradKda(torch.autograd.Function):
    """o = 2 q; backward writes 2 * do into one shared buffer and returns it for q (as fla's
    wy_dv2 / float dq buffers are returned)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        return 2 * q

    @staticmethod
    def backward(ctx, do):
        buf = STATIC.setdefault("dq", torch.empty_like(do))
        buf.copy_(2 * do)
        return buf, None, None, None, None


CALLS: list[bool] = []


def fake_chunk_kda(q, k, v, g, beta, cu_seqlens=None, use_graph=False, **kwargs):
    CALLS.append(use_graph)
    return _StaticGradKda.apply(q, k, v, g, beta), None


def test_gradients_do_not_alias_flas_static_buffers():
    B, T, H, K = 1, 8, 2, 4
    cu = torch.tensor([0, 3, 8])
    CALLS.clear()
    grads = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(B, T, H, K, generator=gen, requires_grad=True)
        k, v, g = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
        beta = torch.rand(B, T, H, generator=gen)
        o, _ = fla_kda_varlen(fake_chunk_kda, cu, q, k, v, g, beta)
        up = torch.randn(o.shape, generator=gen)
        o.backward(up)
        grads.append((q.grad, 2 * up))
    for got, want in grads:   # the first call's gradient survives the second call's backward
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert grads[0][0].data_ptr() != STATIC["dq"].data_ptr()
    assert CALLS == [True, True]   # windows below 16K ask fla for its device-built chunk list


def test_long_windows_take_the_plain_varlen_path():
    """From 16K tokens (never graphed) fla's graph mode, with its process-lifetime buffers, is
    not asked for."""
    CALLS.clear()
    T = 16384
    q, k, v, g = (torch.zeros(1, T, 1, 2) for _ in range(4))
    fla_kda_varlen(fake_chunk_kda, torch.tensor([0, T]), q, k, v, g, torch.zeros(1, T, 1))
    assert CALLS == [False]
