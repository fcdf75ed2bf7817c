"""Row gathers for token dispatch whose backward is a gather too, and the weighted combine.

``x.index_select(0, idx)`` differentiates into ``index_add_``, an atomic scatter: slow in bf16
(measured: see benchmarks/README.md) and its result depends on the order of the
atomics. Dispatch indices have structure that makes the backward a gather:
* a permutation ``perm`` with inverse ``inv``: the gradient is ``grad.index_select(0, inv)``;
* "each token k times" (``order // k`` with ``order`` a permutation of the ``N*k`` slots):
  the gradient of token ``i`` is the sum over its k slots, a gather by ``row_of_slot`` (the
  inverse of ``order``) and a sum over k. Deterministic, no atomics.
The dispatchers now move token rows with the fused passes of ``moe/permute_fused.py`` (which
also handle the static mode's dropped slots and padding rows); ``permute_rows`` still does the
expert-parallel regroup, and ``weighted_sum`` stays as the compiled combine reduction that
``benchmarks/bench_moe_layer.py`` measures.
"""
from __future__ import annotations

import torch

from .compile import compile_on_cuda


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _RepeatRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(row_of_slot)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (row_of_slot,) = ctx.saved_tensors
        per_slot = grad.index_select(0, row_of_slot)  # [N*k, d] in slot order (token-major)
        return per_slot.view(-1, ctx.k, grad.shape[-1]).sum(dim=1), None, None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[perm]`` for ``x [M, d]`` and a permutation ``perm [M]`` of its rows, ``inverse[perm] =
    arange(M)``. Same result as ``x.index_select(0, perm)``; backward gathers by ``inverse``."""
    return _PermuteRows.apply(x, perm, inverse)


def repeat_rows(x: torch.Tensor, order: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    """``x[order // k]`` ``[N*k, d]`` for ``x [N, d]``, where ``order [N*k]`` is a permutation of
    the slots ``i*k + j`` and ``row_of_slot`` its inverse. Backward: each token's gradient is the
    sum of its k slots' rows, gathered (no scatter-add)."""
    return _RepeatRows.apply(x, order, row_of_slot, k)


def weighted_sum_eager(y_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y_slots ``[N*k, d]`` in slot order (token i, choice j at row i*k+j); weights ``[N, k]``
    -> ``[N, d]`` in y's dtype: per token the routing-weighted sum over its k rows, accumulated
    in fp32 at least (the weights are fp32; a bf16 sum would lose bits)."""
    n, k = weights.shape
    acc = torch.promote_types(y_slots.dtype, torch.float32)
    y = y_slots.view(n, k, y_slots.shape[-1]).to(acc)
    return (y * weights.to(acc).unsqueeze(-1)).sum(dim=1).to(y_slots.dtype)


# Eager: upcast, multiply, reduce and downcast, four passes over [N*k, d] forward and more
# backward; compiled: one each way. Static shapes first (dynamic=True compiled a slow
# reduction; measured: see benchmarks/README.md); Dynamo turns dynamic by itself
# once the row count changes (expert parallelism). Not fullgraph: past the recompile limit it
# runs eagerly instead of failing. Outside autocast: its casts are explicit (the sum runs on
# fp32 operands either way), so autocast state need not be a recompile guard.
_weighted_sum = compile_on_cuda(weighted_sum_eager, outside_autocast=True)


def weighted_sum(y_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weighted_sum_eager``, compiled on CUDA (``kernels.compile=false`` keeps it eager)."""
    return _weighted_sum(y_slots, weights)
