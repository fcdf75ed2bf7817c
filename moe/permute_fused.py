"""Dispatch and combine as one row pass each, forward and backward (the fused permutation).

A dispatcher's sort gives two maps between the ``N*k`` slots (slot ``s = i*k + j``: token i's
j-th choice) and the ``M`` rows of its buffer (grouped by destination rank, expert, slot):

* ``row_of_slot [N*k]`` int64: the row holding slot s; ``M`` for a slot that was dropped;
* ``slot_of_row [M]`` int64: the slot filling row r; ``N*k`` for a padding row (zeros).

``dispatch_rows`` writes each token row straight to its rows; ``combine_rows`` gathers each
token's k rows back and reduces them with the routing weights (fp32 accumulate). Autograd:

* dispatch backward: each token's gradient is the sum of its kept slots' row gradients (a
  gather-reduce, no scatter-add, deterministic);
* combine backward: each row's gradient is its slot's weight times the token's output
  gradient (padding rows: zero), and the weight gradient is the dot of the token's output
  gradient with the slot's row (dropped slots: zero).

On CUDA the row passes are Triton kernels (``permute_triton``; ``kernels.moe_permute``,
handed over by ``k3train.ops.kernels.apply`` in ``moe.backends``); elsewhere, for other dtypes,
or where the registry chose torch, they are the torch forms below (the reference: gathers of a
zero-padded tensor, then ``weighted_sum_eager``'s fp32 reduction).
"""
from __future__ import annotations

import functools

import torch

from .backends import current as current_backends
from .permute import weighted_sum_eager

__all__ = ["combine_rows", "dispatch_rows"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _triton():
    try:
        from . import permute_triton
    except ImportError:
        return None
    return permute_triton


class TritonRows:
    """Our Triton row passes as a backend: whether they are importable, and whether they take
    a source of rows ``t`` (fp32/bf16/fp16; the device is the run's choice, checked by the op)."""

    @staticmethod
    def is_available() -> bool:
        return _triton() is not None

    @staticmethod
    def verify(t: torch.Tensor) -> bool:
        return t.dtype in _KERNEL_DTYPES


def _use_triton(t: torch.Tensor) -> bool:
    """Whether the run chose our row passes and they can take ``t``."""
    return (current_backends().moe_permute == "k3train" and t.is_cuda
            and TritonRows.is_available() and TritonRows.verify(t))


def _pad(t: torch.Tensor) -> torch.Tensor:
    """``t`` with one zero row appended: the row that dropped slots and padding rows read."""
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


def _gather_torch(src, slot_of_row, k, weights=None, y=None):
    """Torch form of ``permute_triton.gather_rows`` (same contract)."""
    n = src.shape[0]
    valid = slot_of_row < n * k
    if weights is None:
        token = torch.where(valid, slot_of_row // k, n)
        return _pad(src).index_select(0, token), None
    acc = torch.promote_types(y.dtype, torch.float32)
    slot = torch.where(valid, slot_of_row, n * k)
    w = torch.cat([weights.reshape(-1), weights.new_zeros(1)]).index_select(0, slot)
    g = _pad(src).index_select(0, torch.where(valid, slot_of_row // k, n)).to(acc)
    out = (g * w.to(acc).unsqueeze(-1)).to(y.dtype)
    dots = (g * y.to(acc)).sum(-1).to(weights.dtype)
    gw = weights.new_zeros(n * k + 1).index_copy_(0, slot, dots)[: n * k]   # padding -> cut row
    return out, gw.view(n, k)


def _reduce_torch(src, row_of_slot, n, k, weights=None):
    """Torch form of ``permute_triton.reduce_slots`` (same contract)."""
    rows = _pad(src).index_select(0, row_of_slot)
    if weights is None:
        return rows.view(n, k, src.shape[1]).sum(dim=1)
    return weighted_sum_eager(rows, weights)


def _gather(src, slot_of_row, k, weights=None, y=None):
    if _use_triton(src):
        return _triton().gather_rows(src.contiguous(), slot_of_row, k, weights, y)
    return _gather_torch(src, slot_of_row, k, weights, y)


def _reduce(src, row_of_slot, n, k, weights=None):
    if _use_triton(src):
        w = None if weights is None else weights.contiguous()
        return _triton().reduce_slots(src.contiguous(), row_of_slot, n, k, w)
    return _reduce_torch(src, row_of_slot, n, k, weights)


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_of_slot, slot_of_row, k):
        ctx.save_for_backward(row_of_slot)
        ctx.n, ctx.k = x.shape[0], k
        return _gather(x, slot_of_row, k)[0]

    @staticmethod
    def backward(ctx, grad):
        (row_of_slot,) = ctx.saved_tensors
        return _reduce(grad.contiguous(), row_of_slot, ctx.n, ctx.k), None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_of_slot, slot_of_row, weights):
        ctx.save_for_backward(y, slot_of_row, weights)
        n, k = weights.shape
        return _reduce(y, row_of_slot, n, k, weights)

    @staticmethod
    def backward(ctx, grad):
        y, slot_of_row, weights = ctx.saved_tensors
        gy, gw = _gather(grad.contiguous(), slot_of_row, weights.shape[1], weights, y)
        return gy, None, None, gw if ctx.needs_input_grad[3] else None


def dispatch_rows(x: torch.Tensor, row_of_slot: torch.Tensor, slot_of_row: torch.Tensor,
                  k: int) -> torch.Tensor:
    """x ``[N, d]`` -> buffer ``[M, d]``: row r holds token ``slot_of_row[r] // k`` (zeros for
    padding rows, ``slot_of_row[r] == N*k``). row_of_slot ``[N*k]``, slot_of_row ``[M]``: the
    two maps of the module docstring; they must be consistent (each kept slot has exactly one
    row). Backward: token i's gradient is the sum over its kept slots' rows."""
    return _DispatchRows.apply(x, row_of_slot, slot_of_row, k)


def combine_rows(y: torch.Tensor, row_of_slot: torch.Tensor, slot_of_row: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """y ``[M, d]`` (rows in buffer order), weights ``[N, k]`` -> ``[N, d]`` in y's dtype:
    token i = ``sum_j weights[i, j] * y[row_of_slot[i*k + j]]`` over kept slots, accumulated in
    fp32. Backward gives y's and the weights' gradients (module docstring)."""
    return _CombineRows.apply(y, row_of_slot, slot_of_row, weights)
