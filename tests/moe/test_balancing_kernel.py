"""Quantile Balancing at real router sizes with its cutoff taken by the Triton top-k kernel
(run by Triton's CPU interpreter), against a brute-force reading of the quantile definition.

On CUDA ``quantile_balance`` takes each token's (k+1)-th biased score with
``moe/topk_triton.py``; at K3's 896 experts top-16 that is a top-17, past the kernel's old limit
of 16. Here the child process routes the cutoff through the kernel (``moe.balancing.row_topk``
replaced by it, as ``moe.topk.row_topk`` does on CUDA) and the parent recomputes the bias from
full sorts: per token the (k+1)-th largest of ``s + b``, per expert the (q+1)-th largest margin.
Same fp32 operations on the same values, so the bias must agree bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

_CHILD = """
import sys, torch
import moe.balancing as balancing
from moe.topk_triton import row_topk_triton
balancing.row_topk = row_topk_triton
cases, path = eval(sys.argv[1]), sys.argv[2]
out = {}
for case in cases:
    scores, bias = _inputs(*case)
    out[case] = balancing.quantile_balance(scores, bias, case[2])
torch.save(out, path)
"""


def _inputs(n: int, e: int, k: int):
    """Sigmoid scores ``[n, e]`` fp32 with expert-specific offsets (a skewed load) and an fp32
    bias ``[e]`` such as an earlier update leaves."""
    gen = torch.Generator().manual_seed(n + e + k)
    logits = torch.randn(n, e, generator=gen) + torch.randn(e, generator=gen)
    return torch.sigmoid(logits), torch.randn(e, generator=gen) * 0.05


def _brute_force_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    n, e = scores.shape
    q = n * k // e
    cutoff = torch.sort(scores + bias, dim=1, descending=True).values[:, k:k + 1]
    threshold = torch.sort(scores - cutoff, dim=0, descending=True).values[q]
    new = -threshold
    return new - new.mean()


# K3 (896 experts top-16), 384 and 256 experts top-8; N such that q = N k / E is a few tokens.
CASES = [(120, 896, 16), (100, 384, 8), (64, 256, 8)]


@pytest.fixture(scope="module")
def kernel_bias(tmp_path_factory):
    return run_interpreted(tmp_path_factory.mktemp("qb"), _inputs, _CHILD, CASES)


@pytest.mark.slow  # an interpreted child, ~20 s on a shared 2-core machine
@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}E{}k{}".format(*c))
def test_quantile_balance_with_kernel_cutoff_matches_brute_force(kernel_bias, case):
    scores, bias = _inputs(*case)
    want = _brute_force_bias(scores, bias, case[2])
    got = kernel_bias[case]
    assert got.shape == (case[1],) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
