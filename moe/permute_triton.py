"""The fused token permutation of MoE dispatch and combine as two Triton kernels.

Dispatch writes every row of the send buffer once, combine reads every row once: the row copy
is the whole cost, so each kernel is one pass over the rows (the slot positions come from the
dispatcher's sort, in torch). Terms as in ``moe/permute_fused.py``: slot ``s = i*k + j`` is
token i's j-th choice; ``row_of_slot [N*k]`` is the buffer row of each slot (``M`` = dropped);
``slot_of_row [M]`` the slot filling each row (``N*k`` = a padding row, written as zeros).

* ``_gather_rows_kernel``, one program per block of buffer rows:
  - dispatch forward: ``out[r] = x[slot_of_row[r] // k]`` or zeros;
  - combine backward (WEIGHTED): ``out[r] = w[s] * g[s // k]`` (fp32 product, cast once) and,
    with the buffer row ``y[r]`` in registers anyway, the weight gradient
    ``gw[s] = <g[s // k], y[r]>`` (fp32). Each slot has one row, so the store needs no atomics.
* ``_reduce_slots_kernel``, one program per block of tokens, fp32 accumulation over the k
  slots in order j = 0..k-1 (deterministic, no atomics):
  - combine forward (WEIGHTED): ``out[i] = sum_j w[i, j] * y[row_of_slot[i*k + j]]``;
  - dispatch backward: ``out[i] = sum_j g[row_of_slot[i*k + j]]``.
  Dropped slots (``row_of_slot == M``) add nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_rows", "reduce_slots"]

# Elements one program holds per pass: [rows, BLOCK_D] tiles of about this many values keep
# a K3 row (3584) in one program and batch several k3_mini rows (512) per program.
_TILE = 4096


@triton.jit
def _gather_rows_kernel(src_ptr, slot_ptr, w_ptr, y_ptr, gw_ptr, out_ptr, M, n_slots, D,
                        K: tl.constexpr, WEIGHTED: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=n_slots)
    valid = row_ok & (slot < n_slots)
    token = tl.where(valid, slot // K, 0).to(tl.int64)
    if WEIGHTED:
        w = tl.load(w_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        dot = tl.zeros([ROWS], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        v = tl.load(src_ptr + token[:, None] * D + cols[None, :],
                    mask=valid[:, None] & col_ok[None, :], other=0.0)
        out_off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        store_ok = row_ok[:, None] & col_ok[None, :]
        if WEIGHTED:
            g = v.to(tl.float32)
            y = tl.load(y_ptr + out_off, mask=store_ok, other=0.0).to(tl.float32)
            dot += tl.sum(g * y, axis=1)
            tl.store(out_ptr + out_off, (g * w[:, None]).to(out_ptr.dtype.element_ty), mask=store_ok)
        else:
            tl.store(out_ptr + out_off, v, mask=store_ok)
    if WEIGHTED:
        tl.store(gw_ptr + slot, dot.to(gw_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _reduce_slots_kernel(src_ptr, row_ptr, w_ptr, out_ptr, N, M, D, K: tl.constexpr,
                         WEIGHTED: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tok_ok = tokens < N
    t64 = tokens.to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(row_ptr + t64 * K + j, mask=tok_ok, other=M)
            ok = tok_ok & (row < M)
            v = tl.load(src_ptr + row.to(tl.int64)[:, None] * D + cols[None, :],
                        mask=ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if WEIGHTED:
                w = tl.load(w_ptr + t64 * K + j, mask=ok, other=0.0).to(tl.float32)
                v = v * w[:, None]
            acc += v
        tl.store(out_ptr + t64[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & col_ok[None, :])


def _blocks(d: int) -> tuple[int, int, int]:
    block_d = min(triton.next_power_of_2(max(d, 1)), _TILE)
    rows = max(1, _TILE // block_d)
    return rows, block_d, 8 if block_d >= 2048 else 4


def gather_rows(src: torch.Tensor, slot_of_row: torch.Tensor, k: int,
                weights: torch.Tensor | None = None, y: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """src ``[N, d]`` contiguous, slot_of_row ``[M]`` int64 -> (``[M, d]`` in src's dtype
    (y's with weights), weight grad ``[N, k]`` fp32-accumulated in weights' dtype or None).

    Without weights: row r = ``src[slot_of_row[r] // k]``, zeros where ``slot_of_row[r] >=
    N*k``. With weights ``[N, k]`` and y ``[M, d]``: row r = ``weights[s] * src[s // k]`` and
    the second result holds ``<src[s // k], y[r]>`` per slot (0 for slots with no row)."""
    n, d = src.shape
    m = slot_of_row.shape[0]
    weighted = weights is not None
    out = torch.empty(m, d, dtype=y.dtype if weighted else src.dtype, device=src.device)
    gw = torch.zeros(n, k, dtype=weights.dtype, device=src.device) if weighted else None
    if m == 0 or d == 0:
        return out.zero_(), gw
    rows, block_d, warps = _blocks(d)
    _gather_rows_kernel[(triton.cdiv(m, rows),)](
        src, slot_of_row, weights if weighted else src, y if weighted else src,
        gw if weighted else src, out, m, n * k, d, K=k, WEIGHTED=weighted, ROWS=rows,
        BLOCK_D=block_d, num_warps=warps)
    return out, gw


def reduce_slots(src: torch.Tensor, row_of_slot: torch.Tensor, n: int, k: int,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """src ``[M, d]`` contiguous, row_of_slot ``[n*k]`` int64 -> ``[n, d]`` in src's dtype:
    token i = ``sum_j (weights[i, j] *) src[row_of_slot[i*k + j]]`` over the slots with
    ``row_of_slot < M``, accumulated in fp32."""
    m, d = src.shape
    out = torch.empty(n, d, dtype=src.dtype, device=src.device)
    if n == 0 or d == 0:
        return out
    rows, block_d, warps = _blocks(d)
    _reduce_slots_kernel[(triton.cdiv(n, rows),)](
        src, row_of_slot, weights if weights is not None else src, out, n, m, d, K=k,
        WEIGHTED=weights is not None, ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return out
