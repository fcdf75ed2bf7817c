"""Top-k of each row of a score matrix as one Triton kernel (the router's selection).

torch's CUDA ``topk`` runs a radix select per row, twice per MoE layer (the router's top-k and
Quantile Balancing's top-(k+1) cutoff). A row of up to 1024 scores fits in registers, so each
program here takes a block of rows and picks the maximum k times: one read of the scores
(measured: see benchmarks/README.md).

Layout (docs/quantile_balancing.md#the-router-top-k-kernel): a program holds ``ROWS`` rows of
``EP = next_power_of_2(E)`` columns, ``ROWS * EP = 4096`` (64 rows of 64 for k3_mini, 4 rows of
1024 for K3's 896 experts: the 128 padding columns never win). Each score becomes one int64 key,
its order-preserving fp32 bits above ``EP - 1 - column``: all keys of a row are distinct, the
largest key is the largest score with ties going to the lowest column, and one pick is one
max-reduction plus one compare (the key carries the column, so no second reduction finds it).

Results equal ``torch.topk(scores + bias, k, dim=-1)`` (sorted, largest first): the values
bit for bit (the add is the same fp32 add; values are re-read at the picked columns, so
``-0.0`` and NaN payloads come back as they were), the indices too except that ties go to the
lowest column. NaN counts as larger than any number, as in torch; ``-0.0`` ties with ``+0.0``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["row_topk_triton", "MAX_COLUMNS", "MAX_K"]

MAX_COLUMNS = 1024  # one row lives in registers (4 rows of 1024 int64 keys per 4-warp program)
MAX_K = 32          # the k picks are unrolled; Quantile Balancing at K3 needs top-17
_EMPTY = tl.constexpr(-(1 << 63))  # int64 minimum: the key of padding and of taken entries


@triton.jit
def _row_topk_kernel(s_ptr, b_ptr, val_ptr, idx_ptr, N, E, stride_s,
                     HAS_BIAS: tl.constexpr, K: tl.constexpr, EP: tl.constexpr,
                     ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, EP)
    row_ok = rows < N
    avail = row_ok[:, None] & (cols[None, :] < E)
    row_ptr = s_ptr + rows.to(tl.int64) * stride_s
    v = tl.load(row_ptr[:, None] + cols[None, :], mask=avail, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = v + tl.load(b_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    # fp32 bits -> int32 in the floats' order: non-negative floats keep their bits, negative
    # ones flip all but the sign bit. -0.0 is keyed as +0.0 (they compare equal, so torch
    # breaks the tie by column) and every NaN gets one key above +inf (0x7f800000).
    bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(v != v, 0x7FFFFFFF, ordered)
    # Low 32 bits: EP - 1 - column, so among equal scores the lowest column has the largest
    # key. Padding and taken entries hold int64's minimum, below every real key (the smallest,
    # -inf's, is -0x7f800001 * 2**32), so a row of -inf still gives k distinct columns.
    key = (ordered.to(tl.int64) << 32) | (EP - 1 - cols).to(tl.int64)[None, :]
    key = tl.where(avail, key, _EMPTY)
    for j in tl.static_range(K):
        kmax = tl.max(key, axis=1)
        pick = (EP - 1) - kmax.to(tl.int32)  # truncation keeps the low 32 bits
        value = tl.load(row_ptr + pick, mask=row_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            value = value + tl.load(b_ptr + pick, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(val_ptr + rows * K + j, value.to(val_ptr.dtype.element_ty), mask=row_ok)
        tl.store(idx_ptr + rows * K + j, pick.to(tl.int64), mask=row_ok)
        key = tl.where(key == kmax[:, None], _EMPTY, key)


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
