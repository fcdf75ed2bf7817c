"""The KDA layer's fused-op dispatchers on their torch path, against independent references.

References: a per-token loop for the short convolution, the fp64 recurrent oracle with the gate
written out for ``kda_gated``, a per-head loop for the gated norm, a per-token softmax for the
AttnRes depth mix. Tolerances: fp64 1e-10 (different summation order only).
"""
from __future__ import annotations

import pytest
import torch

from k3train.ops.attnres import attnres_backend, depth_mix, depth_mix_torch
from k3train.ops.gated_norm import head_norm_gate
from k3train.ops.kda import kda_backend, kda_gated, kda_gated_state, l2norm, naive_recurrent_kda
from k3train.ops.short_conv import short_conv_silu
from k3train.config.schema import KernelsConfig
from k3train.ops import kernels

F64 = dict(dtype=torch.float64)


def test_short_conv_silu_matches_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 9, 5, generator=gen, **F64), torch.randn(5, 4, generator=gen, **F64)
    ref = torch.zeros_like(x)
    for t in range(9):
        for j in range(4):  # tap j multiplies token t - 3 + j (zero before the sequence)
            if t - 3 + j >= 0:
                ref[:, t] += w[:, j] * x[:, t - 3 + j]
    torch.testing.assert_close(short_conv_silu(x, w), torch.nn.functional.silu(ref), rtol=1e-10, atol=1e-10)


def test_kda_gated_matches_oracle_with_gate_written_out():
    gen = torch.Generator().manual_seed(1)
    B, T, H, K = 2, 13, 3, 4
    q, k, v, f = (torch.randn(B, T, H, K, generator=gen, **F64) for _ in range(4))
    beta_logits = torch.randn(B, T, H, generator=gen, **F64)
    A_log, dt_bias = torch.randn(H, generator=gen, **F64), torch.randn(H, K, generator=gen, **F64)
    got = kda_gated(q, k, v, f, beta_logits, A_log, dt_bias, -5.0)
    g = torch.empty_like(f)
    for h in range(H):  # the K3 safe gate, head by head
        g[:, :, h] = -5.0 / (1 + torch.exp(-torch.exp(A_log[h]) * (f[:, :, h] + dt_bias[h])))
    ref, _ = naive_recurrent_kda(_fla_l2norm(q), _fla_l2norm(k), v, g, 1 / (1 + torch.exp(-beta_logits)))
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert (g > -5).all() and (g < 0).all()


def _fla_l2norm(x):
    """fla's in-kernel q/k norm (fla/modules/l2norm.py): x / sqrt(sum(x^2) + 1e-6)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def test_l2norm_is_fla_form_for_small_norms():
    """Item 5 of issue 41: the CPU path normalises q and k as fla's kernel does (epsilon inside
    the square root), also where it matters: a norm of 1e-3 leaves |x|^2 = 1e-6 = eps, so the
    result has norm 1/sqrt(2), where a clamped norm (F.normalize) would give 1."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 8, generator=gen, **F64)
    x = x / x.norm(dim=-1, keepdim=True) * torch.tensor([1e-5, 1e-3, 1.0, 10.0], **F64)[:, None, None]
    got = l2norm(x)
    torch.testing.assert_close(got, _fla_l2norm(x), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got[1].norm(dim=-1), torch.full((3,), 2 ** -0.5, **F64), rtol=1e-12, atol=0)
    assert (got[0].norm(dim=-1) < 0.011).all()   # 1e-5 / sqrt(1e-10 + 1e-6): not blown up to 1


def test_kda_gated_state_continues_a_split_sequence():
    """The cache's prefill call: two halves, the second from the first's state, equal the whole
    sequence in one call, and the final state equals the oracle's."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, K = 2, 11, 2, 4
    q, k, v, f = (torch.randn(B, T, H, K, generator=gen, **F64) for _ in range(4))
    b = torch.randn(B, T, H, generator=gen, **F64)
    A_log, dt_bias = torch.randn(H, generator=gen, **F64), torch.randn(H, K, generator=gen, **F64)
    whole, h_whole = kda_gated_state(q, k, v, f, b, A_log, dt_bias, -5.0, output_final_state=True)
    torch.testing.assert_close(whole, kda_gated(q, k, v, f, b, A_log, dt_bias, -5.0), rtol=0, atol=0)
    s = 5
    o1, h1 = kda_gated_state(q[:, :s], k[:, :s], v[:, :s], f[:, :s], b[:, :s], A_log, dt_bias, -5.0,
                             output_final_state=True)
    o2, h2 = kda_gated_state(q[:, s:], k[:, s:], v[:, s:], f[:, s:], b[:, s:], A_log, dt_bias, -5.0,
                             initial_state=h1, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), whole, rtol=1e-10, atol=1e-10)
    g = -5.0 * torch.sigmoid(torch.exp(A_log)[:, None] * (f + dt_bias))
    _, h_ref = naive_recurrent_kda(_fla_l2norm(q), _fla_l2norm(k), v, g, torch.sigmoid(b), output_final_state=True)
    torch.testing.assert_close(h2, h_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h_whole, h_ref, rtol=1e-10, atol=1e-10)


def test_head_norm_gate_matches_per_head_loop():
    gen = torch.Generator().manual_seed(2)
    o, gate = torch.randn(2, 5, 3, 8, generator=gen, **F64), torch.randn(2, 5, 3, 8, generator=gen, **F64)
    w = torch.randn(3, 8, generator=gen, **F64)
    ref = torch.empty_like(o)
    for h in range(3):
        x = o[:, :, h]
        ref[:, :, h] = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w[h] * torch.sigmoid(gate[:, :, h])
    torch.testing.assert_close(head_norm_gate(o, w, gate, 1e-6), ref, rtol=1e-10, atol=1e-10)


def test_depth_mix_matches_per_token_softmax():
    gen = torch.Generator().manual_seed(3)
    srcs = [torch.randn(2, 3, 6, generator=gen, **F64) for _ in range(4)]
    q = torch.randn(6, generator=gen, **F64)
    ref = torch.empty_like(srcs[0])
    for b in range(2):
        for t in range(3):
            vs = torch.stack([s[b, t] for s in srcs])
            logits = torch.stack([(v / torch.sqrt((v * v).mean() + 1e-6) * q).sum() for v in vs])
            ref[b, t] = (torch.softmax(logits, 0)[:, None] * vs).sum(0)
    torch.testing.assert_close(depth_mix(q, srcs, 1e-6), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(depth_mix_torch(q, srcs, 1e-6), ref, rtol=1e-10, atol=1e-10)


def test_kernel_switch(monkeypatch):
    assert kda_backend("cpu") == "torch" and attnres_backend("cpu") == "torch"
    monkeypatch.setenv("K3TRAIN_KERNELS", "torch")
    kernels.apply(KernelsConfig())  # the overrides are read when the choices are resolved
    assert kda_backend("cuda") == "torch" and attnres_backend("cuda") == "torch"
    monkeypatch.setenv("K3TRAIN_KERNELS", "triton")
    with pytest.raises(ValueError, match="K3TRAIN_KERNELS='triton' .*allowed values are 'auto', 'torch'"):
        kernels.apply(KernelsConfig())
