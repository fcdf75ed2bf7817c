"""Token dispatchers: move routed tokens to their experts and bring the outputs back.

The experts only ever see ``x_sorted`` (rows grouped by local expert) and the per-local-expert
counts, so a dispatcher that exchanges tokens between expert-parallel ranks can replace
``LocalDispatcher`` without touching the experts or the layer. Whatever ``combine`` needs
(permutations, routing weights, split sizes) travels in the opaque ``state``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


class TokenDispatcher(ABC):
    """Interface shared by the local and the expert-parallel dispatchers.

    ``num_experts`` is the global expert count (what router indices refer to);
    ``num_local_experts`` is how many experts this rank computes.
    """

    num_experts: int
    num_local_experts: int

    @abstractmethod
    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """x: ``[N, d]``; indices: ``[N, k]`` global expert ids; weights: ``[N, k]``.

        Returns ``(x_sorted [M, d], tokens_per_expert [E_local] int64, state)`` where the rows
        of ``x_sorted`` are grouped by local expert in ascending order.
        """

    @abstractmethod
    def combine(self, y_sorted: torch.Tensor, state: Any) -> torch.Tensor:
        """y_sorted: ``[M, d]`` expert outputs in ``x_sorted`` order -> ``[N, d]``:
        per token, the routing-weighted sum over its k experts, in the original token order."""


@dataclass
class LocalDispatchState:
    """row_of_slot: ``[N*k]`` sorted row holding slot ``i*k + j`` (token i, choice j);
    weights: ``[N, k]`` routing weights."""

    row_of_slot: torch.Tensor
    weights: torch.Tensor


class LocalDispatcher(TokenDispatcher):
    """All experts on this rank: one stable sort by expert id, no communication."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchState]:
        n, k = indices.shape
        flat = indices.reshape(-1)
        # Stable sort: within one expert rows keep token order, so the layout (and any
        # per-expert numerics) does not depend on the sort implementation.
        order = torch.argsort(flat, stable=True)
        row_of_slot = torch.empty_like(order)
        row_of_slot[order] = torch.arange(order.numel(), device=order.device)
        tokens_per_expert = torch.bincount(flat, minlength=self.num_experts)
        state = LocalDispatchState(row_of_slot, weights)
        return x.index_select(0, order // k), tokens_per_expert, state

    def combine(self, y_sorted: torch.Tensor, state: LocalDispatchState) -> torch.Tensor:
        n, k = state.weights.shape
        # Gather back to [N, k, d] and reduce over k instead of a scatter-add: no atomics, so
        # the result is bitwise deterministic on GPU too. The weighted k-way sum runs in at
        # least fp32 (the routing weights are fp32; bf16 accumulation would lose bits).
        acc_dtype = torch.promote_types(y_sorted.dtype, torch.float32)
        y = y_sorted.index_select(0, state.row_of_slot).view(n, k, -1).to(acc_dtype)
        out = (y * state.weights.to(acc_dtype).unsqueeze(-1)).sum(dim=1)
        return out.to(y_sorted.dtype)
