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

from .metrics import expert_load
from .permute_fused import combine_rows, dispatch_rows


class TokenDispatcher(ABC):
    """Interface shared by the local and the expert-parallel dispatchers.

    ``num_experts`` is the global expert count (what router indices refer to);
    ``num_local_experts`` is how many experts this rank computes. A dispatcher keeps no state
    of its own between calls: what one ``dispatch`` dropped comes back in its returned state
    (``state.dropped``: 0-dim int64 slots dropped on this rank, None for dispatchers that never
    drop), for the layer to record.
    """

    num_experts: int
    num_local_experts: int

    @abstractmethod
    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """x: ``[N, d]``; indices: ``[N, k]`` global expert ids; weights: ``[N, k]``.

        Returns ``(x_sorted [M, d], tokens_per_expert [E_local] int64, state)`` where the rows
        of ``x_sorted`` are grouped by local expert in ascending order; ``state.dropped`` is the
        0-dim int64 count of slots this call dropped on this rank (None: the dispatcher never
        drops).
        """

    @abstractmethod
    def combine(self, y_sorted: torch.Tensor, state: Any) -> torch.Tensor:
        """y_sorted: ``[M, d]`` expert outputs in ``x_sorted`` order -> ``[N, d]``:
        per token, the routing-weighted sum over its k experts, in the original token order."""


@dataclass
class LocalDispatchState:
    """row_of_slot: ``[N*k]`` sorted row holding slot ``i*k + j`` (token i, choice j);
    order: ``[N*k]`` its inverse (the slot each sorted row holds); weights: ``[N, k]``.
    dropped: always None (a local dispatch never drops a slot)."""

    row_of_slot: torch.Tensor
    order: torch.Tensor
    weights: torch.Tensor
    dropped: torch.Tensor | None = None


class LocalDispatcher(TokenDispatcher):
    """All experts on this rank: one stable sort by expert id, no communication."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.num_local_experts = num_experts

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchState]:
        k = indices.shape[1]
        flat = indices.reshape(-1)
        # Stable sort: within one expert rows keep token order, so the layout (and any
        # per-expert numerics) does not depend on the sort implementation.
        order = torch.argsort(flat, stable=True)
        row_of_slot = torch.empty_like(order)
        row_of_slot[order] = torch.arange(order.numel(), device=order.device)
        tokens_per_expert = expert_load(flat, self.num_experts)  # no host sync
        state = LocalDispatchState(row_of_slot, order, weights)
        return dispatch_rows(x, row_of_slot, order, k), tokens_per_expert, state

    def combine(self, y_sorted: torch.Tensor, state: LocalDispatchState) -> torch.Tensor:
        # Gather each token's k rows and reduce them instead of a scatter-add: no atomics, so
        # the result is bitwise deterministic on GPU too (moe/permute_fused.py).
        return combine_rows(y_sorted, state.row_of_slot, state.order, state.weights)
