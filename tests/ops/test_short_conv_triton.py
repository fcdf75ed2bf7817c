"""Our Triton short convolution (``k3train/ops/short_conv_triton.py``), run by Triton's CPU
interpreter, against a per-token loop in fp64 written out here: output, input gradient and
weight gradient. Tolerance 1e-5 (the kernels compute in fp32 from fp32 inputs).

The interpreter runs the same kernel source as a GPU with one fixed tile config; the GPU run
(autotuned tiles, bf16) is checked by ``scripts/gpu_check.py`` against the torch form.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

# Run in a child process with the interpreter on (tests/triton_interpreter.py); it saves
# its results for the checks here.
_CHILD = """
import sys, torch
from k3train.ops.short_conv_triton import short_conv_silu_triton
cases, path = eval(sys.argv[1]), sys.argv[2]
out = {}
for B, T, C, W in cases:
    x, w, dy = _inputs(B, T, C, W)
    x.requires_grad_(); w.requires_grad_()
    y = short_conv_silu_triton(x, w)
    out[(B, T, C, W)] = (y.detach(), *torch.autograd.grad(y, (x, w), dy))
try:
    short_conv_silu_triton(torch.randn(2, 5, 8), torch.randn(6, 4))
except ValueError as e:
    out["error"] = str(e)
torch.save(out, path)
"""


def _inputs(B: int, T: int, C: int, W: int):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + W)
    return (torch.randn(B, T, C, generator=gen), torch.randn(C, W, generator=gen),
            torch.randn(B, T, C, generator=gen))


def _loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(sum_j w[:, j] * x[t - W + 1 + j]), token by token (zeros before token 0)."""
    W = w.shape[1]
    z = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for j in range(W):
            if t - W + 1 + j >= 0:
                z[:, t] += w[:, j] * x[:, t - W + 1 + j]
    return torch.nn.functional.silu(z)


# Shapes cross the interpreter's 16-row x 32-channel tiles: partial tiles in time and channels,
# a sequence shorter than the width, and widths 2-4.
CASES = [(2, 37, 24, 4), (1, 40, 70, 3), (3, 2, 33, 4), (1, 17, 8, 2)]


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    return run_interpreted(tmp_path_factory.mktemp("conv"), _inputs, _CHILD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}C{}W{}".format(*c))
def test_forward_and_gradients_match_token_loop(kernel_results, case):
    y, gx, gw = kernel_results[case]
    x, w, dy = _inputs(*case)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = _loop(x64, w64)
    rx, rw = torch.autograd.grad(ref, (x64, w64), dy.double())
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.double(), ref, **tol)
    torch.testing.assert_close(gx.double(), rx, **tol)
    torch.testing.assert_close(gw.double(), rw, **tol)
    assert gw.dtype == w.dtype and gx.dtype == x.dtype


def test_rejects_mismatched_shapes(kernel_results):
    assert "x must be [B, T, C] and weight [C, W] with 2 <= W <= 4" in kernel_results["error"]
