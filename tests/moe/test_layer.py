"""LatentMoE, experts, router and activations against independent per-token loops."""
from __future__ import annotations

import math

import pytest
import torch

from moe import (GroupedExperts, LatentMoE, LocalDispatcher, SigmoidTopKRouter,
                 grouped_mm_supported, situ, situ_glu, switch_aux_loss)


# ---------------------------------------------------------------- activations

def _situ_scalar(g: float, beta: float = 4.0) -> float:
    return beta * math.tanh(g / beta) / (1.0 + math.exp(-g))


@pytest.mark.parametrize("g", [-7.5, -1.0, 0.3, 2.0, 11.0])
def test_situ_matches_formula(g):
    got = situ(torch.tensor(g, dtype=torch.float64)).item()
    assert got == pytest.approx(_situ_scalar(g), rel=1e-12, abs=1e-15)


def test_situ_limits():
    assert situ(torch.zeros(3)).abs().max().item() == 0.0
    # Saturates at beta (tanh -> 1, sigmoid -> 1) and decays to 0 for very negative g.
    assert situ(torch.tensor(200.0, dtype=torch.float64)).item() == pytest.approx(4.0, abs=1e-12)
    assert situ(torch.tensor(60.0), beta=2.0).item() == pytest.approx(2.0, abs=1e-6)
    assert abs(situ(torch.tensor(-60.0)).item()) < 1e-20


def test_situ_glu_matches_formula():
    gate = torch.tensor([0.0, 1.5, -2.0, 30.0], dtype=torch.float64)
    up = torch.tensor([3.0, -4.0, 100.0, 1e4], dtype=torch.float64)
    got = situ_glu(gate, up)
    want = [_situ_scalar(g) * 25.0 * math.tanh(u / 25.0) for g, u in zip(gate.tolist(), up.tolist())]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    # The up branch is capped at beta_lin: the product is bounded by beta * beta_lin.
    assert situ_glu(torch.tensor(1e3), torch.tensor(1e6)).item() == pytest.approx(100.0)


# ---------------------------------------------------------------- grouped experts

def _expert_grads(experts, x, counts, loop: bool):
    x = x.clone().requires_grad_(True)
    y = (experts.forward_loop if loop else experts)(x, counts)
    g = torch.randn_like(y, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(y, [x, experts.w_gate, experts.w_up, experts.w_down], g)
    return y, grads


@pytest.mark.parametrize("counts", [[5, 0, 3, 9], [0, 0, 17, 0], [0, 4, 4, 0]],
                         ids=["E4-zero-mid", "E4-one-busy", "E4-zero-ends"])
def test_grouped_matches_loop(counts, monkeypatch):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 12)
    counts_t = torch.tensor(counts)
    x = torch.randn(sum(counts), 8)
    assert grouped_mm_supported(x, experts.w_gate) and grouped_mm_supported(x, experts.w_down)
    y_loop, g_loop = _expert_grads(experts, x, counts_t, loop=True)
    # Prove the grouped path really ran: the loop must not be reached from forward().
    monkeypatch.setattr(experts, "forward_loop", lambda *a: pytest.fail("fell back to loop"))
    y_grp, g_grp = _expert_grads(experts, x, counts_t, loop=False)
    torch.testing.assert_close(y_grp, y_loop, rtol=1e-5, atol=1e-7)
    for a, b in zip(g_grp, g_loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_grouped_path_under_autocast_with_fp32_masters(monkeypatch):
    """Under bf16 autocast (how the trainer runs on GPU) bf16 activations meet fp32 master
    weights: the grouped GEMM must still run (casting both, as autocast casts a Linear), not
    the per-expert loop with its host sync, and match the fp32 loop within bf16 rounding."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 24)
    counts = torch.tensor([5, 0, 3, 9])
    x = torch.randn(17, 16)
    y_ref, g_ref = _expert_grads(experts, x, counts, loop=True)          # fp32 reference
    monkeypatch.setattr(experts, "forward_loop", lambda *a: pytest.fail("fell back to loop"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, grads = _expert_grads(experts, x.bfloat16(), counts, loop=False)
    assert y.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads[1:])              # masters stay fp32
    for got, want in zip([y, *grads], [y_ref, *g_ref]):
        rel = (got.float() - want).norm() / want.norm()
        assert rel < 2e-2, rel


def test_grouped_backward_accepts_expanded_grad():
    # y.sum() hands _grouped_mm's backward a stride-0 gradient, which it rejects unless made
    # contiguous first.
    torch.manual_seed(0)
    experts = GroupedExperts(3, 8, 8)
    x = torch.randn(7, 8, requires_grad=True)
    counts = torch.tensor([2, 0, 5])
    experts(x, counts).sum().backward()
    want = torch.autograd.grad(experts.forward_loop(x, counts).sum(), x)[0]
    torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-7)


def test_grouped_fallbacks_and_init():
    torch.manual_seed(3)
    a = GroupedExperts(3, 6, 10)           # 6 * 4 bytes: not 16-byte aligned -> loop fallback
    torch.manual_seed(3)
    b = GroupedExperts(3, 6, 10)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.w_gate.std().item() == pytest.approx(0.02, rel=0.2)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 6)
    assert not grouped_mm_supported(x, a.w_gate)
    torch.testing.assert_close(a(x, counts), a.forward_loop(x, counts))
    a64 = a.double()                       # fp64 is rejected by _grouped_mm on CPU
    assert not grouped_mm_supported(x.double(), a64.w_gate)
    assert a64(x.double(), counts).dtype == torch.float64


def test_every_expert_shard_is_the_slice_of_the_whole_module():
    """Holding all experts, init draws into the parameters directly; an EP shard draws the whole
    set and keeps its slice. Both must give the same experts for the same seed."""
    torch.manual_seed(5)
    whole = GroupedExperts(6, 16, 24)
    for lo, n in ((0, 3), (3, 3), (2, 2)):
        torch.manual_seed(5)
        shard = GroupedExperts(n, 16, 24, expert_offset=lo, total_experts=6)
        for name in ("w_gate", "w_up", "w_down"):
            assert torch.equal(getattr(shard, name), getattr(whole, name)[lo:lo + n]), (lo, name)


def test_grouped_bf16_close_to_fp32():
    torch.manual_seed(0)
    experts = GroupedExperts(3, 16, 32)
    counts = torch.tensor([4, 0, 6])
    x = torch.randn(10, 16)
    ref = experts(x, counts)
    y = experts.to(torch.bfloat16)(x.bfloat16(), counts)
    torch.testing.assert_close(y.float(), ref, rtol=5e-2, atol=5e-3)


# ---------------------------------------------------------------- router

def test_router_weights_and_bias():
    torch.manual_seed(0)
    router = SigmoidTopKRouter(16, 6, 2)
    x = torch.randn(20, 16)
    out = router(x)
    torch.testing.assert_close(out.scores, torch.sigmoid(x @ router.weight.T))
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(20))
    picked = out.scores.gather(-1, out.indices)
    torch.testing.assert_close(out.weights, picked / picked.sum(-1, keepdim=True))
    assert "bias" in dict(router.named_buffers()) and "bias" in router.state_dict()
    assert all(name != "bias" for name, _ in router.named_parameters())

    # A large bias on expert 5 forces it into every selection, but the scores (the source of
    # the weights) are untouched, and the weights still renormalise the raw scores.
    router.bias[5] = 10.0
    biased = router(x)
    assert (biased.indices == 5).any(-1).all()
    torch.testing.assert_close(biased.scores, out.scores)
    picked = biased.scores.gather(-1, biased.indices)
    torch.testing.assert_close(biased.weights, picked / picked.sum(-1, keepdim=True))

    # Gradient flows through the scores into the router weight, never into the bias.
    biased.weights[:, 0].sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert not router.bias.requires_grad


# ---------------------------------------------------------------- LatentMoE vs per-token loop

def _rmsnorm(v, w, eps=1e-6):
    return v / torch.sqrt((v * v).mean() + eps) * w


def _glu(v, wg, wu, wd, beta=4.0, beta_lin=25.0):
    g, u = v @ wg, v @ wu
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))
    return act @ wd


def _reference(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice, each expert from its own weight slices."""
    r, ex = moe.router, moe.experts
    rows = []
    for i in range(x.shape[0]):
        xi = x[i]
        scores = torch.sigmoid(r.weight @ xi)
        chosen = torch.topk(scores.detach() + r.bias, moe.topk).indices.tolist()
        total = sum(scores[e] for e in chosen)
        latent = moe.down.weight @ xi
        acc = torch.zeros_like(latent)
        for e in chosen:
            acc = acc + scores[e] / total * _glu(latent, ex.w_gate[e], ex.w_up[e], ex.w_down[e])
        out = moe.up.weight @ _rmsnorm(acc, moe.norm.weight)
        if moe.shared is not None:
            s = moe.shared
            out = out + _glu(xi, s.gate_proj.weight.T, s.up_proj.weight.T, s.down_proj.weight.T)
        rows.append(out)
    return torch.stack(rows)


def _make_moe(shared: int, dtype, latent=8) -> LatentMoE:
    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=12, latent_size=latent, num_experts=6, topk=2,
                    expert_ffn_size=8, num_shared_experts=shared, shared_ffn_size=4,
                    init_std=0.3).to(dtype)
    with torch.no_grad():
        moe.router.bias.copy_(torch.randn(6) * 0.2)   # make the bias change some selections
        moe.norm.weight.uniform_(0.5, 1.5)
    return moe


@pytest.mark.parametrize("shared", [0, 2], ids=["no-shared", "shared2"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)],
                         ids=["fp64-loop-path", "fp32-grouped-path"])
def test_latent_moe_matches_per_token_loop(shared, dtype, tol):
    moe = _make_moe(shared, dtype)
    assert (moe.shared is None) == (shared == 0)
    x = torch.randn(2, 7, 12, dtype=dtype, requires_grad=True)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == dtype
    xr = x.detach().clone().requires_grad_(True)
    ref = _reference(moe, xr.reshape(-1, 12)).reshape(x.shape)
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)

    params = [p for p in moe.parameters()]
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x] + params, g)
    want = torch.autograd.grad(ref, [xr] + params, g)
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def test_latent_moe_state_and_aux_loss():
    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=16, latent_size=16, num_experts=4, topk=2, expert_ffn_size=8,
                    num_shared_experts=1, shared_ffn_size=8, aux_loss_coef=0.01)
    assert moe.down.weight.shape == (16, 16)      # latent == hidden keeps down/up
    x = torch.randn(10, 16)
    y = moe(x)
    assert y.shape == (10, 16)
    r = moe.routing.last
    assert not r.scores.requires_grad and r.indices.shape == (10, 2)
    assert moe.routing.last_tokens_per_expert.tolist() == torch.bincount(r.indices.flatten(), minlength=4).tolist()
    f = torch.bincount(r.indices.flatten(), minlength=4).double() / 20
    p = (r.scores / r.scores.sum(-1, keepdim=True)).mean(0).double()
    assert moe.routing.aux_loss.item() == pytest.approx(0.01 * 4 * (f * p).sum().item(), rel=1e-5)
    moe.routing.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    # Perfectly uniform routing gives the loss its minimum value 1.
    uniform = torch.full((8, 4), 0.5)
    idx = torch.tensor([[0, 1], [2, 3]] * 4)
    assert switch_aux_loss(uniform, idx, 4, 2).item() == pytest.approx(1.0)
    plain = LatentMoE(hidden_size=16, latent_size=8, num_experts=4, topk=2, expert_ffn_size=8)
    plain(torch.randn(3, 16))
    assert plain.routing.aux_loss is None             # no coefficient, no loss


def test_dispatcher_roundtrip_identity_experts():
    # With identity experts, combine(dispatch(x)) is the weight-sum of k copies of x.
    disp = LocalDispatcher(5)
    x = torch.randn(9, 3)
    idx = torch.tensor([[4, 0], [1, 4], [2, 3], [0, 1], [4, 2], [3, 0], [1, 2], [0, 4], [3, 1]])
    w = torch.rand(9, 2)
    xs, counts, state = disp.dispatch(x, idx, w)
    assert counts.tolist() == [4, 4, 3, 3, 4]
    sorted_ids = torch.repeat_interleave(torch.arange(5), counts)
    for row, e in enumerate(sorted_ids.tolist()):   # every row sits in its expert's block
        assert any(torch.equal(xs[row], x[i]) for i in range(9) if e in idx[i].tolist())
    torch.testing.assert_close(disp.combine(xs, state), x * w.sum(-1, keepdim=True))


def test_router_bias_stays_fp32_under_bf16_cast():
    router = SigmoidTopKRouter(8, 4, 2)
    router.bias.copy_(torch.tensor([1e-3, -2.5e-4, 3e-5, 0.0]))
    before = router.bias.clone()
    router = router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.bias.dtype == torch.float32 and torch.equal(router.bias, before)
    assert router(torch.randn(3, 8, dtype=torch.bfloat16)).weights.dtype == torch.float32


def test_situ_glu_traces_whole_for_compile():
    """situ_glu is compiled whole on CUDA (fullgraph): tracing it with AOT autograd on CPU must
    succeed without graph breaks and give the eager values and gradients."""
    from moe.activations import situ_glu_eager

    torch.manual_seed(0)
    gate, up = (torch.randn(64, 48, requires_grad=True) * 6 for _ in range(2))
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    traced = torch.compile(situ_glu_eager, fullgraph=True, backend="aot_eager")
    want = situ_glu_eager(gate, up, 4.0, 25.0)
    g_want = torch.autograd.grad(want.square().sum(), [gate, up])
    got = traced(gate, up, 4.0, 25.0)
    g_got = torch.autograd.grad(got.square().sum(), [gate, up])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(situ_glu(gate, up), situ_glu_eager(gate, up))  # CPU takes the eager form


def test_gathered_path_equals_the_loop_in_fp64_with_an_empty_expert():
    """forward_gathered (no host read: the fp32 compiled decode step's capturable path) against
    the per-expert loop, fp64, counts with an empty expert first, in the middle and last."""
    torch.manual_seed(5)
    experts = GroupedExperts(5, 8, 12).double()
    counts = torch.tensor([0, 3, 0, 4, 0])
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    got = experts.forward_gathered(x, counts)
    want = experts.forward_loop(x, counts)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad(got.square().sum(), [x, experts.w_gate, experts.w_down])
    g_want = torch.autograd.grad(want.square().sum(), [x, experts.w_gate, experts.w_down])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
