"""Muon: Newton-Schulz against an fp64 transcription, per-head blocks, update RMS, resume."""
from __future__ import annotations

import math

import pytest
import torch

from optim import Muon, muon_update, newton_schulz


def reference_newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The published quintic iteration written out for one [A, B] matrix, in fp64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.double()
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.t()
    X = X / (torch.linalg.matrix_norm(X, ord="fro") + eps)
    for _ in range(steps):
        A = X @ X.t()
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.t() if transposed else X


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (7, 130)],
                         ids=lambda s: f"A{s[0]}-B{s[1]}")
def test_newton_schulz_matches_reference(shape):
    torch.manual_seed(0)
    G = torch.randn(shape)
    out = newton_schulz(G)
    assert out.dtype == G.dtype and out.shape == G.shape
    torch.testing.assert_close(out.double(), reference_newton_schulz(G), atol=2e-4, rtol=1e-4)


def test_newton_schulz_batched_and_dtype():
    torch.manual_seed(1)
    G = torch.randn(3, 16, 40)
    out = newton_schulz(G, steps=4)
    for i in range(3):
        torch.testing.assert_close(out[i], newton_schulz(G[i], steps=4), atol=1e-6, rtol=1e-5)
    # Each matrix is normalised by its own norm: scaling one block must not change the others.
    G2 = G.clone()
    G2[0] *= 100.0
    torch.testing.assert_close(newton_schulz(G2, steps=4)[1:], out[1:], atol=1e-6, rtol=1e-5)
    assert newton_schulz(G.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        newton_schulz(torch.randn(5))


def test_newton_schulz_singular_value_band():
    # p(x) = a x + b x^3 + c x^5 has p(1) ~ 0.70, so 1 is not a fixed point: the coefficients
    # trade exact convergence for a steep slope at 0. Iterating p maps [0, 1] into the band
    # ~[0.682, 1.134] (measured on 200 seeds of 64x32 Gaussians: 0.6818 .. 1.1344).
    for seed in range(5):
        torch.manual_seed(seed)
        s = torch.linalg.svdvals(newton_schulz(torch.randn(64, 32)).double())
        assert s.min() > 0.67 and s.max() < 1.145, (seed, s.min().item(), s.max().item())


def test_per_head_blocks():
    torch.manual_seed(2)
    g = torch.randn(64, 32)
    kw = dict(momentum=0.0, nesterov=False, ns_steps=5)
    whole = muon_update(g, torch.zeros_like(g), heads=None, **kw)
    one = muon_update(g, torch.zeros_like(g), heads=1, **kw)
    torch.testing.assert_close(one, whole, atol=0, rtol=0)

    per_head = muon_update(g, torch.zeros_like(g), heads=4, **kw)
    # Each 16x32 row block orthogonalised on its own, scaled by its own shape.
    expected = torch.cat([newton_schulz(blk) * 0.2 * math.sqrt(32) for blk in g.split(16, 0)])
    torch.testing.assert_close(per_head, expected, atol=1e-5, rtol=1e-5)
    assert (per_head - whole).abs().max() > 0.05

    with pytest.raises(ValueError, match="not divisible by heads=5"):
        muon_update(g, torch.zeros_like(g), heads=5, **kw)
    w = torch.nn.Parameter(torch.zeros(64, 32))
    with pytest.raises(ValueError, match="'attn.q'.*not divisible"):
        Muon([{"params": [("attn.q", w)], "heads": 3}], lr=0.1)


def test_per_head_tall_blocks():
    # Heads whose blocks are taller than wide (an MLA kv_b_proj [H * 256, 128]): Newton-Schulz
    # iterates on the transpose and hands back a non-contiguous stack. This failed with "view
    # size is not compatible" on the first GPU study that set a narrow kv_lora_rank.
    torch.manual_seed(4)
    g = torch.randn(4 * 24, 16)
    kw = dict(momentum=0.0, nesterov=False, ns_steps=5)
    per_head = muon_update(g, torch.zeros_like(g), heads=4, **kw)
    expected = torch.cat([newton_schulz(blk) * 0.2 * math.sqrt(24) for blk in g.split(24, 0)])
    torch.testing.assert_close(per_head, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(64, 64), (128, 32), (32, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_update_rms_matches_adamw(shape):
    # With lr=1 and no weight decay the applied update is exactly the scaled NS output; its
    # RMS should be ~0.2 (what AdamW gives), within the spread of NS singular values.
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(shape))
    opt = Muon([p], lr=1.0, weight_decay=0.0)
    before = p.detach().clone()
    p.grad = torch.randn(shape)
    opt.step()
    rms = (p.detach() - before).pow(2).mean().sqrt().item()
    assert 0.16 < rms < 0.24, rms


@pytest.mark.parametrize("nesterov", [True, False])
def test_single_and_second_step_by_hand(nesterov):
    torch.manual_seed(4)
    lr, wd, mu = 0.05, 0.1, 0.9
    p0 = torch.randn(16, 24)
    g1, g2 = torch.randn(16, 24), torch.randn(16, 24)
    p = torch.nn.Parameter(p0.clone())
    opt = Muon([p], lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov)
    scale = 0.2 * math.sqrt(24)

    p.grad = g1.clone()
    opt.step()
    buf = g1
    u = g1 + mu * buf if nesterov else buf
    p1 = p0 * (1 - lr * wd) - lr * scale * newton_schulz(u)
    torch.testing.assert_close(p.detach(), p1, atol=1e-6, rtol=1e-6)

    p.grad = g2.clone()
    opt.step()
    buf = mu * g1 + g2
    u = g2 + mu * buf if nesterov else buf
    p2 = p1 * (1 - lr * wd) - lr * scale * newton_schulz(u)
    torch.testing.assert_close(p.detach(), p2, atol=1e-6, rtol=1e-6)


def test_rejects_non_matrix_with_name():
    with pytest.raises(ValueError, match="2-D.*'norm.weight'"):
        Muon([("norm.weight", torch.nn.Parameter(torch.ones(8)))], lr=0.1)
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.ones(2, 3, 4, 5))], lr=0.1)
    with pytest.raises(ValueError, match="per-head Muon splits the rows of a 2-D matrix"):
        Muon([{"params": [torch.nn.Parameter(torch.ones(2, 8, 4))], "heads": 2}], lr=0.1)


@pytest.mark.parametrize("nesterov", [True, False])
def test_expert_stack_equals_separate_matrices(nesterov):
    """A [S, A, B] parameter (routed experts) steps exactly as S separate [A, B] parameters."""
    torch.manual_seed(3)
    stack = torch.nn.Parameter(torch.randn(5, 12, 20))
    singles = [torch.nn.Parameter(stack.detach()[i].clone()) for i in range(5)]
    kw = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    opt_stack, opt_singles = Muon([stack], **kw), Muon(singles, **kw)
    for _ in range(3):
        g = torch.randn(5, 12, 20)
        stack.grad = g.clone()
        for i, p in enumerate(singles):
            p.grad = g[i].clone()
        opt_stack.step()
        opt_singles.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in singles]), atol=1e-6, rtol=1e-6)
    # Each expert's update is orthogonalised on its own: its RMS is the per-matrix Moonlight scale.
    upd = muon_update(torch.randn(5, 12, 20), torch.zeros(5, 12, 20), momentum=0.9, nesterov=False,
                      heads=None, ns_steps=5)
    rms = upd.pow(2).mean(dim=(1, 2)).sqrt()
    assert ((rms > 0.1) & (rms < 0.3)).all(), rms


def _make(seed: int):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(24, 40))]
    opt = Muon([{"params": params[:1], "heads": 4}, {"params": params[1:], "lr": 0.03}],
               lr=0.02, weight_decay=0.1)
    return params, opt


def _step(params, opt, k: int):
    gen = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def test_state_dict_resume_bitwise():
    ref_params, ref_opt = _make(0)
    for k in range(3):
        _step(ref_params, ref_opt, k)

    params, opt = _make(0)
    for k in range(2):
        _step(params, opt, k)
    saved_opt = opt.state_dict()
    saved_params = [p.detach().clone() for p in params]

    new_params, new_opt = _make(1)  # different init: everything must come from the checkpoint
    with torch.no_grad():
        for p, s in zip(new_params, saved_params):
            p.copy_(s)
    new_opt.load_state_dict(saved_opt)
    _step(new_params, new_opt, 2)
    for p, r in zip(new_params, ref_params):
        assert torch.equal(p, r)


@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_step_equals_one_matrix_at_a_time(nesterov, monkeypatch):
    """Muon.step batches same-shape matrices (one Newton-Schulz call for all their head
    blocks); two steps must equal muon_update applied matrix by matrix, including groups of
    several shapes and head splits, a parameter without a gradient and a batch cap hit."""
    import optim.muon as muon_mod

    monkeypatch.setattr(muon_mod, "_BATCH_ELEMS", 3 * 32 * 24)   # 3 matrices of 32x24 per call
    torch.manual_seed(5)
    specs = [((32, 24), None)] * 5 + [((32, 24), 4)] * 3 + [((16, 40), None)] * 2 + [((8, 8), None)]
    params = [torch.nn.Parameter(torch.randn(shape)) for shape, _ in specs]
    heads = [h for _, h in specs]
    ref = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    lr, wd, mu = 0.03, 0.1, 0.9
    opt = Muon([{"params": params, "heads": heads}], lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov)
    for step in range(2):
        grads = [torch.randn_like(p) for p in params]
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if (i == 10 and step == 0) else g.clone()
        opt.step()
        for i, g in enumerate(grads):
            if i == 10 and step == 0:
                continue
            upd = muon_update(g, bufs[i], momentum=mu, nesterov=nesterov, heads=heads[i], ns_steps=5)
            ref[i] = ref[i] * (1 - lr * wd) - lr * upd
    for p, r, buf in zip(params, ref, bufs):
        torch.testing.assert_close(p.detach(), r, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, atol=0, rtol=0)


def test_out_scale_rides_on_the_last_gemm():
    """``out_scale`` is a plain factor on the result (applied in the last GEMM, not a pass)."""
    torch.manual_seed(8)
    G = torch.randn(3, 24, 40)
    torch.testing.assert_close(newton_schulz(G, out_scale=-0.37), -0.37 * newton_schulz(G),
                               atol=1e-6, rtol=1e-5)


def test_apply_updates_promotes_a_narrow_update():
    """``p = decay * p + u`` in one pass, with a bf16 update added to fp32 weights in fp32
    (reference: the update cast up first, then the two terms)."""
    from optim import apply_muon_updates

    torch.manual_seed(9)
    ps = [torch.randn(16, 8), torch.randn(4, 16, 8)]
    us = [torch.randn(16, 8).bfloat16(), torch.randn(4, 16, 8).bfloat16()]
    for decay in (1.0, 0.99):
        got = [p.clone() for p in ps]
        apply_muon_updates(got, us, decay)
        for g, p, u in zip(got, ps, us):
            torch.testing.assert_close(g, decay * p + u.float(), atol=1e-6, rtol=1e-6)


def test_largest_first_orders_groups_by_total_size():
    """Muon.step starts with the biggest stacks (host launches then hide behind their GEMMs)."""
    from optim.muon import largest_first

    same = {"small": [torch.zeros(3, 3)] * 5, "stack": [torch.zeros(4, 8, 8)], "mid": [torch.zeros(10, 10)]}
    assert [k for k, _ in largest_first(same, torch.Tensor.numel)] == ["stack", "mid", "small"]


def test_cuda_kernels_resolve_by_name():
    """Muon finds its Triton kernels by module and name on CUDA; CPU runs never look them up,
    so a renamed kernel would only fail on a GPU. Guard the names here."""
    pytest.importorskip("triton")
    from optim.momentum_triton import momentum_nesterov_triton
    from optim.muon import _triton_kernel
    from optim.ns_gemm_triton import baddbmm_triton

    assert _triton_kernel("momentum_triton", "momentum_nesterov_triton") is momentum_nesterov_triton
    assert _triton_kernel("ns_gemm_triton", "baddbmm_triton") is baddbmm_triton
