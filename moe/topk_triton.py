"""Top-k of each row of a narrow score matrix as one Triton kernel (the router's selection).

torch's CUDA ``topk`` runs a radix select per row, twice per MoE layer (the router's top-4 and
Quantile Balancing's top-5 cutoff) on k3_mini's ``[16384, 64]`` scores. A row of 64 scores fits
in registers, so each program here takes a block of rows and picks the maximum k times: one
read of the scores (measured: see docs/BENCHMARKS.md#router-top-k-and-quantile-balancing).

Results equal ``torch.topk(scores + bias, k, dim=-1)`` (sorted, largest first): the values
bit for bit (the add is the same fp32 add), the indices too except that ties go to the lowest
column. NaN counts as larger than any number, as in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["row_topk_triton", "MAX_COLUMNS", "MAX_K"]

MAX_COLUMNS = 1024  # one row lives in registers; wider rows use torch.topk
MAX_K = 16          # the k picks are unrolled


@triton.jit
def _row_topk_kernel(s_ptr, b_ptr, val_ptr, idx_ptr, N, E, stride_s,
                     HAS_BIAS: tl.constexpr, K: tl.constexpr, EP: tl.constexpr,
                     ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, EP)
    row_ok = rows < N
    avail = row_ok[:, None] & (cols[None, :] < E)
    v = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_s + cols[None, :], mask=avail,
                other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = v + tl.load(b_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    # Selection key: NaN ranks above +inf (torch's order); taken and padding columns drop out
    # through `avail`, not through a sentinel value, so rows of -inf still give k distinct picks.
    key = tl.where(v != v, float("inf"), v)
    is_nan = v != v
    for j in tl.static_range(K):
        kmax = tl.max(tl.where(avail, key, float("-inf")), axis=1)
        nan_left = tl.max(tl.where(avail & is_nan, 1, 0), axis=1) > 0
        hit = avail & (key == kmax[:, None]) & (is_nan | ~nan_left[:, None])
        pick = tl.min(tl.where(hit, cols[None, :], EP), axis=1)
        chosen = cols[None, :] == pick[:, None]
        value = tl.sum(tl.where(chosen, v, 0.0), axis=1)
        tl.store(val_ptr + rows * K + j, value.to(val_ptr.dtype.element_ty), mask=row_ok)
        tl.store(idx_ptr + rows * K + j, pick.to(tl.int64), mask=row_ok)
        avail = avail & ~chosen


def row_topk_triton(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores ``[N, E]`` (unit stride in E), bias ``[E]`` or None -> (values ``[N, k]`` in
    ``promote(scores, bias)``, indices ``[N, k]`` int64), largest first; ``k <= MAX_K``,
    ``E <= MAX_COLUMNS``."""
    if scores.ndim != 2 or scores.stride(-1) != 1:
        raise ValueError(f"row_topk_triton needs a [N, E] tensor with unit column stride, got "
                         f"shape {tuple(scores.shape)} strides {scores.stride()}")
    n, e = scores.shape
    if not 0 < k <= min(e, MAX_K) or e > MAX_COLUMNS:
        raise ValueError(f"row_topk_triton: k={k} must be in [1, min(E={e}, {MAX_K})] and "
                         f"E <= {MAX_COLUMNS}")
    dtype = scores.dtype if bias is None else torch.promote_types(scores.dtype, bias.dtype)
    values = torch.empty(n, k, dtype=dtype, device=scores.device)
    # Zeros, not empty: k3train.ops.triton_compile.compile_ahead dry-runs a step with Triton
    # launches replaced by compiles, and uninitialised indices would then reach gathers.
    indices = torch.zeros(n, k, dtype=torch.int64, device=scores.device)
    if n == 0:
        return values, indices
    ep = triton.next_power_of_2(e)
    rows = max(1, min(64, 4096 // ep))
    _row_topk_kernel[(triton.cdiv(n, rows),)](
        scores, bias if bias is not None else scores, values, indices, n, e, scores.stride(0),
        HAS_BIAS=bias is not None, K=k, EP=ep, ROWS=rows, num_warps=4)
    return values, indices
