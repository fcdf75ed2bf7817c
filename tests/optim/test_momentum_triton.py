"""Muon's fused momentum kernel (``optim/momentum_triton.py``), run by Triton's CPU interpreter,
against the two torch passes it replaces (``buf = g + mu buf``; ``u = g + mu buf`` or ``buf``),
over three steps so the momentum state carries: equal to fp32 rounding (rtol 1e-6, one
multiply-add may be fused); bf16 outputs within one bf16 ulp (rtol 8e-3).

The GPU run is checked by ``scripts/gpu_check.py`` (Muon on CUDA vs on CPU).
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

_CHILD = """
import sys, torch
from optim.momentum_triton import momentum_nesterov_triton
cases, path = eval(sys.argv[1]), sys.argv[2]
out = {}
for case in cases:
    grads, buf, u = _inputs(*case)
    us = []
    for g in grads:
        momentum_nesterov_triton(g, buf, u, 0.95, case[1])
        us.append(u.clone())
    out[case] = (buf, us)
try:
    momentum_nesterov_triton(torch.randn(4, 6), torch.randn(6, 4).t(), torch.randn(4, 6), 0.9, True)
except ValueError as e:
    out["error"] = str(e)
torch.save(out, path)
"""


def _inputs(numel: int, nesterov: bool, buf_dtype: str, u_dtype: str, steps: int):
    """``steps`` gradients, a momentum buffer (non-zero: a resumed run) and the output slot."""
    gen = torch.Generator().manual_seed(numel + nesterov)
    grads = [torch.randn(numel, generator=gen) for _ in range(steps)]
    buf = torch.randn(numel, generator=gen).to(getattr(torch, buf_dtype))
    return grads, buf, torch.empty(numel, dtype=getattr(torch, u_dtype))


# One partial block (5000 = 4096 + 904), one tiny; bf16 Newton-Schulz input as on CUDA; a bf16
# momentum buffer (bf16 parameters); plain heavy-ball momentum. The bf16 state runs one step:
# Triton's interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest), so over several
# steps its state drifts from a round-to-nearest reference by more than the casts' own ulp.
CASES = [(5000, True, "float32", "bfloat16", 3), (7, True, "float32", "float32", 3),
         (5000, True, "bfloat16", "bfloat16", 1), (300, False, "float32", "float32", 3)]


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    return run_interpreted(tmp_path_factory.mktemp("mom"), _inputs, _CHILD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}-nesterov{}-{}-{}-steps{}".format(*c))
def test_matches_two_torch_passes(kernel_results, case):
    buf_k, us_k = kernel_results[case]
    grads, buf, u = _inputs(*case)
    for g, u_k in zip(grads, us_k):
        # The reference in fp32 (the kernel's arithmetic); u uses the momentum before it is
        # rounded to a bf16 state (torch's second pass would read the rounded one).
        b32 = g + 0.95 * buf.float()
        buf = b32.to(buf.dtype)
        ref_u = (g + 0.95 * b32) if case[1] else b32
        tol = dict(rtol=1e-6, atol=1e-6) if u.dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(u_k.float(), ref_u.to(u.dtype).float(), **tol)
    tol = dict(rtol=1e-6, atol=1e-6) if buf.dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(buf_k, buf, **tol)


def test_bad_layout_is_named(kernel_results):
    assert "contiguous" in kernel_results["error"]
