"""KDA ops: the recurrent oracle against hand-expanded algebra, and the chunked form against the oracle.

Tolerances: fp64 rtol = atol = 1e-10 (forward, final state and every gradient); fp32 against the
fp64 oracle rtol = atol = 1e-5 forward and state / 1e-4 gradients (observed: ~2e-7 / ~4e-6);
bf16 inputs against the fp64 oracle atol = 1e-2 (observed ~2e-3, from rounding the inputs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3train.ops.kda import chunk_kda_torch, kda, kda_backend, naive_recurrent_kda


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # These tensors are tiny: intra-op threads only add synchronisation, which on a loaded
    # 2-core machine made the module ~8x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_inputs(B, T, H, K, V, dtype=torch.float64, seed=0, h0=False):
    """Realistic KDA inputs: unit-norm q,k, log-decay in [-5, 0], beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    g = -5 * torch.sigmoid(randn(B, T, H, K))
    beta = torch.sigmoid(randn(B, T, H))
    inputs = [x.to(dtype) for x in (q, k, v, g, beta)]
    state = randn(B, H, K, V).to(torch.float64 if dtype == torch.float64 else torch.float32) if h0 else None
    return inputs, state


def run_with_grads(fn, inputs, h0, seed=1, **kw):
    """Outputs and autograd gradients of a random projection of ``(o, final_state)``."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    h0_leaf = h0.detach().clone().requires_grad_() if h0 is not None else None
    o, ht = fn(*leaves, initial_state=h0_leaf, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.dtype)
    ((o * do).sum() + (ht * dht).sum()).backward()
    grads = [x.grad for x in leaves] + ([h0_leaf.grad] if h0_leaf is not None else [])
    return o.detach(), ht.detach(), grads


GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]

# (B, T, H, K, V, chunk_size): T = 1, not a multiple, an exact multiple, and several chunks.
CASES = [
    (2, 1, 2, 16, 32, 16),
    (2, 37, 2, 16, 32, 16),
    (2, 100, 2, 16, 32, 32),
    (1, 64, 1, 32, 16, 64),
    (1, 150, 2, 32, 32, 64),
    (1, 45, 1, 8, 8, 20),
]
CASE_IDS = [f"B{b}-T{t}-H{h}-K{k}-V{v}-C{c}" for b, t, h, k, v, c in CASES]


@pytest.mark.parametrize("h0", [False, True], ids=["noh0", "h0"])
@pytest.mark.parametrize("B,T,H,K,V,C", CASES, ids=CASE_IDS)
def test_chunk_matches_naive_fp64(B, T, H, K, V, C, h0):
    inputs, state = make_inputs(B, T, H, K, V, h0=h0)
    o_ref, ht_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, state)
    o, ht, grads = run_with_grads(chunk_kda_torch, inputs, state, chunk_size=C)
    assert o.dtype == ht.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(GRAD_NAMES, grads, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("h0", [False, True], ids=["noh0", "h0"])
@pytest.mark.parametrize("B,T,H,K,V,C", [CASES[2], CASES[4]], ids=[CASE_IDS[2], CASE_IDS[4]])
def test_chunk_fp32_close_to_fp64_oracle(B, T, H, K, V, C, h0):
    inputs, state = make_inputs(B, T, H, K, V, h0=h0)
    o_ref, ht_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, state)
    inputs32 = [x.float() for x in inputs]
    state32 = state.float() if state is not None else None
    o, ht, grads = run_with_grads(chunk_kda_torch, inputs32, state32, chunk_size=C)
    assert o.dtype == ht.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(GRAD_NAMES, grads, g_ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_chunk_fp32_strong_decay_stays_finite():
    """g = -20 spans ~-1280 of log-decay per 64-token chunk: exp(+G) would overflow fp32."""
    inputs, state = make_inputs(2, 200, 2, 16, 16, h0=True)
    inputs[3] = torch.full_like(inputs[3], -20.0)
    inputs[3][:, ::7] = 0.0  # some no-decay steps so there is still signal to compare
    o_ref, ht_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, state)
    o, ht, grads = run_with_grads(chunk_kda_torch, [x.float() for x in inputs], state.float(), chunk_size=64)
    assert all(torch.isfinite(x).all() for x in [o, ht, *grads])
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(GRAD_NAMES, grads, g_ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_inputs_return_bf16_and_fp32_state():
    inputs, state = make_inputs(2, 70, 2, 16, 16, h0=True)
    o_ref, ht_ref = naive_recurrent_kda(*inputs, initial_state=state, output_final_state=True)
    bf = [x.bfloat16() for x in inputs]
    for fn in (naive_recurrent_kda, chunk_kda_torch):
        o, ht = fn(*bf, initial_state=state.float(), output_final_state=True)
        assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
        torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=1e-2)
        torch.testing.assert_close(ht.double(), ht_ref, rtol=0, atol=1e-2)


def test_final_state_none_unless_requested():
    inputs, _ = make_inputs(1, 10, 1, 8, 8)
    assert naive_recurrent_kda(*inputs)[1] is None
    assert chunk_kda_torch(*inputs)[1] is None


def test_chunked_state_passing_composes():
    """Running two halves with the state handed over equals one run over the whole sequence."""
    inputs, state = make_inputs(1, 90, 2, 16, 16, h0=True)
    o_full, ht_full = chunk_kda_torch(*inputs, initial_state=state, output_final_state=True, chunk_size=32)
    first = [x[:, :50] for x in inputs]
    second = [x[:, 50:] for x in inputs]
    o1, h_mid = chunk_kda_torch(*first, initial_state=state, output_final_state=True, chunk_size=32)
    o2, ht = chunk_kda_torch(*second, initial_state=h_mid, output_final_state=True, chunk_size=32)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_full, rtol=1e-10, atol=1e-10)


def test_naive_matches_hand_expanded_two_steps():
    """Oracle vs the recurrence written with explicit K x K matrices, per (b, h), for T = 2."""
    B, H, K, V = 2, 3, 5, 4
    (q, k, v, g, beta), S0 = make_inputs(B, 2, H, K, V, h0=True)
    scale = 0.7
    o, ST = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=S0, output_final_state=True)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):

            def step(t, S):
                kt = k[b, t, h].unsqueeze(1)  # [K, 1]
                transition = (eye - beta[b, t, h] * kt @ kt.T) @ torch.diag(g[b, t, h].exp())
                return transition @ S + beta[b, t, h] * kt @ v[b, t, h].unsqueeze(0)

            S1 = step(0, S0[b, h])
            S2 = step(1, S1)
            torch.testing.assert_close(o[b, 0, h], S1.T @ (scale * q[b, 0, h]), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(o[b, 1, h], S2.T @ (scale * q[b, 1, h]), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ST[b, h], S2, rtol=1e-12, atol=1e-12)


def test_naive_delta_rule_properties():
    """beta = 1 with a unit key overwrites: S_t^T k_t = v_t; beta = 0, g = 0 leaves S fixed."""
    (q, k, v, g, beta), S0 = make_inputs(1, 6, 2, 8, 4, h0=True)
    for t in range(1, 7):
        _, S = naive_recurrent_kda(q[:, :t], k[:, :t], v[:, :t], g[:, :t], torch.ones_like(beta[:, :t]),
                                   initial_state=S0, output_final_state=True)
        recalled = torch.einsum("bhk,bhkv->bhv", k[:, t - 1], S)
        torch.testing.assert_close(recalled, v[:, t - 1], rtol=1e-12, atol=1e-12)
    o, S = naive_recurrent_kda(q, k, v, torch.zeros_like(g), torch.zeros_like(beta), scale=1.0,
                               initial_state=S0, output_final_state=True)
    torch.testing.assert_close(S, S0, rtol=0, atol=0)
    torch.testing.assert_close(o, torch.einsum("bthk,bhkv->bthv", q, S0), rtol=1e-12, atol=1e-12)


def test_dispatcher_uses_torch_on_cpu():
    assert kda_backend("cpu") == "torch"
    assert kda_backend(torch.device("cpu")) == "torch"
    inputs, state = make_inputs(1, 20, 2, 8, 8, h0=True)
    o, ht = kda(*inputs, initial_state=state, output_final_state=True)
    o_ref, ht_ref = chunk_kda_torch(*inputs, initial_state=state, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)
