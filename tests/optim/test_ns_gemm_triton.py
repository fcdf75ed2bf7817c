"""The Newton-Schulz GEMM (``optim/ns_gemm_triton.py``), run by Triton's CPU interpreter, against
``beta * C + alpha * A @ B`` in fp64: partial tiles, a transposed operand view (``X.mT``, as the
Newton-Schulz Gram matrix uses), C equal to an operand, no C. Tolerance 1e-5 relative (fp32
inputs, fp32 accumulation).

The GPU run (autotuned tiles, bf16) is checked by ``benchmarks/bench_muon.py`` against
torch's ``baddbmm``.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

_CHILD = """
import sys, torch
from optim.ns_gemm_triton import baddbmm_triton
cases, path = eval(sys.argv[1]), sys.argv[2]
out = {}
for case in cases:
    C, A, B, beta, alpha = _operands(*case)
    out[case] = baddbmm_triton(C, A, B, beta=beta, alpha=alpha)
for bad in ((None, torch.randn(2, 3, 4), torch.randn(2, 5, 6)), (torch.randn(2, 3, 3), torch.randn(2, 3, 4), torch.randn(2, 4, 6))):
    try:
        baddbmm_triton(*bad)
    except ValueError as e:
        out.setdefault("errors", []).append(str(e))
torch.save(out, path)
"""


def _operands(s: int, m: int, k: int, n: int, kind: str):
    """(C, A, B, beta, alpha) for one case; ``kind`` picks how the operands are laid out."""
    gen = torch.Generator().manual_seed(s * 1000 + m * 10 + k + n)
    X = torch.randn(s, m, k, generator=gen)
    if kind == "gram":                       # A = X, B = X^T (a strided view), no C
        return None, X, X.mT, 0.0, 1.0
    if kind == "square":                     # b A + c A A with C = A = B (Newton-Schulz's B step)
        return X, X, X, -4.775, 2.0315
    Bm = torch.randn(s, k, n, generator=gen)
    return torch.randn(s, m, n, generator=gen), X, Bm, 3.4445, 0.5


CASES = [(3, 37, 37, 37, "square"), (2, 20, 45, 20, "gram"), (2, 33, 18, 50, "general"),
         (1, 8, 8, 8, "square")]


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    return run_interpreted(tmp_path_factory.mktemp("nsgemm"), _operands, _CHILD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "S{}M{}K{}N{}-{}".format(*c))
def test_matches_fp64_baddbmm(kernel_results, case):
    C, A, B, beta, alpha = _operands(*case)
    ref = alpha * (A.double() @ B.double())
    if C is not None:
        ref = ref + beta * C.double()
    got = kernel_results[case]
    assert got.shape == ref.shape and got.dtype == A.dtype
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named(kernel_results):
    mismatch, bad_c = kernel_results["errors"]
    assert "A [S, M, K] and B [S, K, N]" in mismatch
    assert "C has shape (2, 3, 3)" in bad_c
