"""The fused permutation (``moe/permute_fused.py``): torch form against plain loops, and the
Triton kernels (``moe/permute_triton.py``, run by Triton's CPU interpreter) against the torch
form, forward and backward, with dropped slots and padding rows (static mode) and without
(dynamic mode). The GPU run is checked by ``benchmarks/bench_moe_permute.py --check``.

Tolerances: the torch form is the loops' arithmetic in another order (fp32: 1e-6); the kernels
accumulate the same fp32 products in slot order (fp32: 1e-5; bf16 outputs: a bf16 ulp).
"""
from __future__ import annotations

import pytest
import torch

from moe.permute_fused import combine_rows, dispatch_rows
from tests.triton_interpreter import run_interpreted


def _maps(n: int, k: int, e: int, cap, seed: int):
    """Routing of n tokens to k distinct experts of e, and the two maps built by a loop:
    static (``cap`` slots per expert, later tokens dropped, free slots padding) or dynamic
    (``cap=None``: rows expert-major, no drops). Returns (row_of_slot, slot_of_row, weights,
    rows M); also x, dy and dout inputs for the checks."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=gen)
    per_expert = [[] for _ in range(e)]
    for i in range(n):
        for j in range(k):
            per_expert[int(indices[i, j])].append(i * k + j)
    if cap is None:
        order = [s for slots in per_expert for s in slots]
        m = len(order)
        slot_of_row = order
    else:
        m = e * cap
        slot_of_row = [n * k] * m
        for ex, slots in enumerate(per_expert):
            for pos, s in enumerate(slots[:cap]):
                slot_of_row[ex * cap + pos] = s
    row_of_slot = [m] * (n * k)
    for r, s in enumerate(slot_of_row):
        if s < n * k:
            row_of_slot[s] = r
    return torch.tensor(row_of_slot), torch.tensor(slot_of_row), weights, m


def _loop_dispatch(x, slot_of_row, k):
    rows = [x[int(s) // k] if s < x.shape[0] * k else torch.zeros_like(x[0]) for s in slot_of_row]
    return torch.stack(rows)


def _loop_combine(y, row_of_slot, weights):
    n, k = weights.shape
    out = []
    for i in range(n):
        acc = torch.zeros(y.shape[1], dtype=torch.float64)
        for j in range(k):
            r = int(row_of_slot[i * k + j])
            if r < y.shape[0]:
                acc = acc + weights[i, j].double() * y[r].double()
        out.append(acc)
    return torch.stack(out).to(y.dtype)


# (n, k, e, cap, d): dynamic, static with drops and padding, static with nothing dropped.
CASES = [(9, 2, 4, None, 6), (13, 3, 6, 4, 5), (7, 2, 4, 7, 3)]


@pytest.mark.parametrize("case", CASES, ids=["dynamic", "static-drops", "static-nodrop"])
def test_torch_form_matches_loops_forward_and_backward(case):
    n, k, e, cap, d = case
    row_of_slot, slot_of_row, w, m = _maps(n, k, e, cap, seed=1)
    dropped = int((row_of_slot == m).sum())
    assert (dropped > 0) == (case is CASES[1]) and (cap is None or m == e * cap)
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    y = torch.randn(m, d, dtype=torch.float64, requires_grad=True)
    wt = w.double().requires_grad_(True)
    g_disp, g_comb = torch.randn(m, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)

    got = (dispatch_rows(x, row_of_slot, slot_of_row, k), combine_rows(y, row_of_slot, slot_of_row, wt))
    grads = torch.autograd.grad((got[0] * g_disp).sum() + (got[1] * g_comb).sum(), (x, y, wt))
    want = (_loop_dispatch(x, slot_of_row, k), _loop_combine(y, row_of_slot, wt))
    want_grads = torch.autograd.grad((want[0] * g_disp).sum() + (want[1] * g_comb).sum(), (x, y, wt))
    for a, b in zip(got + grads, want + want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # padding rows are exact zeros, and dropped slots get exactly zero weight gradient
    assert not got[0][slot_of_row == n * k].any() and not grads[1][slot_of_row == n * k].any()
    assert not grads[2].reshape(-1)[row_of_slot == m].any()


_CHILD = """
import sys, torch
import moe.permute_fused as pf
pf._use_triton = lambda t: True          # the interpreter runs the kernels on CPU tensors
cases, path = eval(sys.argv[1]), sys.argv[2]
out = {}
for case in cases:
    out[case] = _run(pf, *case)
torch.save(out, path)
"""


def _run(pf, n, k, e, cap, d, dtype):
    """Forward and backward of both fused ops on the inputs of ``_maps``; shared by the child
    (Triton) and the parent (torch form)."""
    row_of_slot, slot_of_row, w, m = _maps(n, k, e, cap, seed=n + d)
    gen = torch.Generator().manual_seed(d)
    dt = getattr(torch, dtype)
    x = torch.randn(n, d, generator=gen).to(dt).requires_grad_(True)
    y = torch.randn(m, d, generator=gen).to(dt).requires_grad_(True)
    wt = w.clone().requires_grad_(True)
    g_disp, g_comb = torch.randn(m, d, generator=gen).to(dt), torch.randn(n, d, generator=gen).to(dt)
    a = pf.dispatch_rows(x, row_of_slot, slot_of_row, k)
    b = pf.combine_rows(y, row_of_slot, slot_of_row, wt)
    grads = torch.autograd.grad([a, b], [x, y, wt], [g_disp, g_comb])
    return [t.detach() for t in (a, b) + grads]


# Row counts that are not a multiple of a program's row block, d not a power of two, d past
# one 4096-wide tile (the column loop), top-16.
TRITON_CASES = [(9, 2, 4, None, 6, "float32"), (13, 3, 6, 4, 5, "float32"),
                (21, 4, 8, 5, 40, "bfloat16"), (5, 2, 3, 2, 4100, "float32"),
                (6, 16, 20, 3, 8, "bfloat16")]


@pytest.mark.slow
def test_triton_kernels_match_torch_form(tmp_path):
    pytest.importorskip("triton")
    import moe.permute_fused as pf

    got = run_interpreted(tmp_path, _maps, "\n" + __import__("inspect").getsource(_run) + _CHILD,
                          TRITON_CASES)
    names = ("dispatch", "combine", "dx", "dy", "dweights")
    for case in TRITON_CASES:
        want = _run(pf, *case)
        for name, a, b in zip(names, got[case], want):
            # bf16 results: one rounding of fp32 sums taken in another order, so at most one
            # bf16 ulp apart (2**-7 relative); the weight gradient is fp32 whatever the rows.
            bf16 = a.dtype == torch.bfloat16
            tol = dict(rtol=2 ** -7, atol=1e-3) if bf16 else dict(rtol=1e-5, atol=1e-5)
            assert a.dtype == b.dtype and a.shape == b.shape, (case, name)
            if name == "dispatch":                         # a copy: bit for bit
                assert torch.equal(a, b), (case, name)
            else:
                torch.testing.assert_close(a, b, **tol, msg=lambda msg: f"{case} {name}: {msg}")
