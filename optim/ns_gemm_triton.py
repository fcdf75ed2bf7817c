"""``out = beta * C + alpha * A @ B`` for stacks of matrices as one Triton kernel, C apart from out.

Newton-Schulz runs two such products per step (``B = b A + c A A`` and ``X' = a X + B X``).
torch's ``baddbmm`` hands cuBLAS one buffer for C and the result, so it first copies C into a
new output, about half the product's time on k3_mini's ``[512, 512, 512]`` bf16 stacks. Here
each program reads its C tile in the epilogue and writes the result elsewhere: no copy, and
bitwise equal results (``benchmarks/bench_muon.py``; measured: see
benchmarks/README.md). The Gram product ``X X^T`` has no C, and cuBLAS's
own is faster there.

Shapes: A ``[S, M, K]``, B ``[S, K, N]``, C and out ``[S, M, N]``, any strides (``X.mT`` is a
view); accumulation in fp32, one rounding to out's dtype.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["baddbmm_triton"]

_CONFIGS = [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in ((128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8),
                                     (128, 128, 64, 3, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4))]


@triton.jit
def _baddbmm_kernel(a_ptr, b_ptr, c_ptr, o_ptr, M, N, K: tl.constexpr,
                    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_ob, s_om, s_on,
                    alpha, beta, HAS_C: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GROUP: tl.constexpr):
    pid, batch = tl.program_id(0), tl.program_id(1).to(tl.int64)
    # Grouped tile order: GROUP row-blocks share their B column-blocks while they sit in L2.
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group_id = pid // (GROUP * tiles_n)
    first_m = group_id * GROUP
    size_m = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % (GROUP * tiles_n)) % size_m
    pid_n = (pid % (GROUP * tiles_n)) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = a_ptr + batch * s_ab + rm[:, None] * s_am + rk[None, :] * s_ak
    b = b_ptr + batch * s_bb + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # K is a compile-time constant: Newton-Schulz sees a handful of widths, and Triton's CPU
    # interpreter cannot loop to a runtime bound.
    for k in tl.range(0, K, BK):
        k_left = K - k
        a_tile = tl.load(a, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        b_tile = tl.load(b, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
        a += BK * s_ak
        b += BK * s_bk
    acc = acc * alpha
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_C:
        c = tl.load(c_ptr + batch * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn, mask=mask, other=0.0)
        acc += beta * c.to(tl.float32)
    tl.store(o_ptr + batch * s_ob + rm[:, None] * s_om + rn[None, :] * s_on,
             acc.to(o_ptr.dtype.element_ty), mask=mask)


# Autotuned on a GPU (keyed on the matrix shape); Triton's CPU interpreter (the tests) cannot
# time kernels, so there one small config runs. cache_results keeps the choice on disk.
_tuned = triton.autotune(configs=_CONFIGS, key=["M", "N", "K"], cache_results=True)(_baddbmm_kernel)
_INTERPRET_CONFIG = {"BM": 16, "BN": 16, "BK": 16, "GROUP": 2}


def baddbmm_triton(C: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor, *, beta: float = 1.0,
                   alpha: float = 1.0) -> torch.Tensor:
    """``beta * C + alpha * A @ B`` (``alpha * A @ B`` when C is None) in a new tensor of A's
    dtype. A ``[S, M, K]``, B ``[S, K, N]``, C ``[S, M, N]``; C may be A or B themselves."""
    if A.ndim != 3 or B.ndim != 3 or A.shape[0] != B.shape[0] or A.shape[2] != B.shape[1]:
        raise ValueError(f"baddbmm_triton needs A [S, M, K] and B [S, K, N], got "
                         f"{tuple(A.shape)} and {tuple(B.shape)}")
    S, M, K = A.shape
    N = B.shape[2]
    if C is not None and C.shape != (S, M, N):
        raise ValueError(f"baddbmm_triton: C has shape {tuple(C.shape)}, expected {(S, M, N)}")
    out = torch.empty(S, M, N, dtype=A.dtype, device=A.device)
    c = C if C is not None else out
    args = (A, B, c, out, M, N, K, *A.stride(), *B.stride(), *c.stride(), *out.stride(),
            alpha, beta)
    if os.environ.get("TRITON_INTERPRET") == "1":
        cfg = _INTERPRET_CONFIG
        grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]), S)
        _baddbmm_kernel[grid](*args, HAS_C=C is not None, **cfg)
    else:
        _tuned[lambda m: (triton.cdiv(M, m["BM"]) * triton.cdiv(N, m["BN"]), S)](
            *args, HAS_C=C is not None)
    return out
