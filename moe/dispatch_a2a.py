"""Expert-parallel token dispatcher: one all-to-all of tokens per direction.

Experts are placed contiguously: EP rank r owns global experts ``[r*E_local, (r+1)*E_local)``,
so one stable sort of the ``N*k`` (token, choice) slots by global expert id orders them by
destination rank and, within a rank, by local expert. Each direction then moves all rows with
ONE ``all_to_all_single`` (never one per expert). Rows arrive grouped by (source rank, local
expert); a second, local permutation regroups them by (local expert, source rank), the layout
``GroupedExperts`` expects. Within one expert, rows are in (source rank, token) order: the same
order ``LocalDispatcher`` gives over the concatenation of every rank's tokens.

Two modes:

* dynamic (``capacity_factor=None``, the default): exact, never drops a slot. The split sizes
  depend on the routing, so after a tiny all-to-all of the per-(rank, expert) counts the
  counts are read on the host once per layer forward (one device sync on GPU); combine and
  both backwards reuse those host split sizes and do not sync again. At EP=1 there is nothing
  to exchange: no host read (the buffer is the ``N*k`` slot rows in expert order).
* static (``capacity_factor=c``): every (source rank, expert) pair gets
  ``C = ceil(c * N * k / E)`` slots; slots past C are dropped (the earliest tokens win) and
  free slots are zero rows. Every split size is ``E_local * C``, so nothing is read on the
  host: the step can be captured in a CUDA graph or overlapped with compute. All ranks of the
  EP group must pass the same ``N`` (a fixed micro-batch shape) so that they agree on C.

The permutations on both sides are the fused row passes of ``moe/permute_fused.py`` (Triton
on CUDA): dispatch writes each token row straight to its (destination rank, expert, slot) row
of the send buffer, combine gathers each token's k rows back and reduces them with the routing
weights; the maps they use are ``row_of_slot`` and ``slot_of_row`` in the state.

Default for the trainer: dynamic. It is exact (the loss does not depend on the EP layout, which
tests/moe/test_dispatch_a2a.py checks against one process) and, with balanced routing, its one small sync per layer is cheap
next to the all-to-all itself. Static is the choice once CUDA graphs or compute/communication
overlap matter more than the few dropped slots; the CPU tests run both.

Static mode, padding and ``tokens_per_expert``: the experts receive fixed blocks of ``ep*C``
rows per local expert and ``tokens_per_expert`` is that padded size (``ep*C`` each). Passing
the real counts instead would be wrong: the grouped GEMM turns counts into contiguous offsets,
and real rows of expert e are not contiguous in a padded block, so expert e+1 would compute
padding and real rows of expert e. With padded counts every row is computed by its own
expert; the padding rows are zeros and:
  * forward: combine never reads a padding row's output, so it cannot reach any token;
  * backward: combine hands padding rows an exactly zero output gradient, so every weight
    gradient term they add (``x^T dgate``, ``h^T dy``) is exactly zero whatever the expert.
The cost is expert FLOPs on the padding (``(c - 1)/c`` of the work when nothing is dropped),
inherent to fixed shapes. The returned state's ``real_tokens_per_expert`` (dynamic: same as the
returned counts; static: ``None``, it would need another exchange) and ``dropped`` report the
load; the dispatcher itself keeps no per-call state.
Dropped slots contribute zero and the kept weights are not renormalised (as in GShard).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .dispatch import TokenDispatcher
from .permute import permute_rows
from .permute_fused import combine_rows, dispatch_rows


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with autograd: backward is the reverse exchange.

    x: ``[sum(in_splits), d]`` -> ``[sum(out_splits), d]``; splits are host lists (None = equal
    splits). The gradient of a row travels back to the rank it came from, so backward swaps
    the two split lists. ``torch.distributed.nn.functional.all_to_all_single`` does the same and
    works on gloo with uneven splits (checked on torch 2.13), but it is deprecated (FutureWarning)
    in favour of the functional collectives; this small Function depends on neither.
    """

    @staticmethod
    def forward(ctx, x, out_rows, out_splits, in_splits, group):
        ctx.in_rows, ctx.group = x.shape[0], group
        ctx.out_splits, ctx.in_splits = out_splits, in_splits
        out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((ctx.in_rows,) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits,
                               group=ctx.group)
        return out, None, None, None, None


def all_to_all_rows(x: torch.Tensor, out_rows: int, out_splits: list[int] | None,
                    in_splits: list[int] | None, group=None) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` over dim 0 (see ``_AllToAll``)."""
    return _AllToAll.apply(x, out_rows, out_splits, in_splits, group)


@dataclass
class A2ADispatchState:
    """What combine needs. row_of_slot: ``[N*k]`` send-buffer row holding slot ``i*k+j``
    (static: ``E*C`` for dropped slots); weights ``[N, k]``; slot_of_row: ``[rows]`` the slot
    filling each send-buffer row (static: ``N*k`` for padding rows); the pair drives the fused
    row passes (``moe/permute_fused.py``). Dynamic only: host split lists, and for EP > 1
    regroup ``[M]`` (x_sorted row m = received row regroup[m]) and its inverse. Static only:
    ``capacity`` C. Reported load: ``dropped`` 0-dim int64 slots this rank dropped (always 0
    in dynamic mode; a device tensor, never read on the host here) and
    ``real_tokens_per_expert`` ``[E_local]`` real rows per local expert (dynamic) or None."""

    row_of_slot: torch.Tensor
    weights: torch.Tensor
    slot_of_row: torch.Tensor
    dropped: torch.Tensor | None = None
    real_tokens_per_expert: torch.Tensor | None = None
    regroup: torch.Tensor | None = None
    regroup_inverse: torch.Tensor | None = None
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    capacity: int = 0


class GroupedAllToAllDispatcher(TokenDispatcher):
    """Token dispatcher over an expert-parallel group (module docstring).

    Args:
        num_experts: global expert count E; must be divisible by the EP size.
        ep_group: expert-parallel process group; None = the world group (or a single rank
            without communication when torch.distributed is not initialised).
        capacity_factor: None = dynamic mode; a float c > 0 = static mode with
            ``C = ceil(c * N * k / E)`` slots per (source rank, expert).

    ``dispatch`` writes nothing on the dispatcher: the dropped slots and real counts of a call
    are in the state it returns (``A2ADispatchState.dropped``, ``.real_tokens_per_expert``).
    """

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None = None,
                 capacity_factor: float | None = None):
        self.group = ep_group
        self._comm = dist.is_available() and dist.is_initialized()
        if ep_group is not None and not self._comm:
            raise ValueError("an ep_group was given but torch.distributed is not initialised")
        self.ep_size = dist.get_world_size(ep_group) if self._comm else 1
        self.ep_rank = dist.get_rank(ep_group) if self._comm else 0
        if num_experts % self.ep_size != 0:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                             f"size {self.ep_size}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.capacity_factor = capacity_factor

    @property
    def mode(self) -> str:
        return "dynamic" if self.capacity_factor is None else "static"

    def capacity(self, num_tokens: int, topk: int) -> int:
        """Slots per (source rank, expert) in static mode: ``ceil(c * N * k / E)``."""
        return math.ceil(self.capacity_factor * num_tokens * topk / self.num_experts)

    def _exchange(self, x, out_rows, out_splits, in_splits):
        if not self._comm or self.ep_size == 1:    # one rank: the exchange is the identity
            return x
        return all_to_all_rows(x, out_rows, out_splits, in_splits, self.group)

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, A2ADispatchState]:
        """x ``[N, d]``, indices ``[N, k]`` global ids, weights ``[N, k]`` ->
        ``(x_sorted [M, d], tokens_per_expert [E_local] int64, state)``; dynamic: M = rows
        received; static: M = E_local * ep * C."""
        if self.capacity_factor is None:
            return self._dispatch_dynamic(x, indices, weights)
        return self._dispatch_static(x, indices, weights)

    def combine(self, y_sorted: torch.Tensor, state: A2ADispatchState) -> torch.Tensor:
        """y_sorted ``[M, d]`` in x_sorted order -> ``[N, d]`` routing-weighted sum over k."""
        if self.capacity_factor is None:
            return self._combine_dynamic(y_sorted, state)
        return self._combine_static(y_sorted, state)

    def _slot_order(self, indices: torch.Tensor):
        flat = indices.reshape(-1)
        # Stable: within one expert slots keep token order (and "earliest tokens win" below).
        order = torch.argsort(flat, stable=True)
        # scatter_add of ones, not bincount: CUDA bincount reads max() on the host.
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        return flat, order, counts

    # ------------------------------------------------------------------ dynamic
    def _dispatch_dynamic(self, x, indices, weights):
        k = indices.shape[1]
        ep, e_loc = self.ep_size, self.num_local_experts
        _, order, counts = self._slot_order(indices)
        row_of_slot = torch.empty_like(order)
        row_of_slot[order] = torch.arange(order.numel(), device=order.device)
        x_perm = dispatch_rows(x, row_of_slot, order, k)          # [N*k, d], expert-major
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        if ep == 1:     # nothing to exchange: no split sizes, no host read, no regroup
            return x_perm, counts, A2ADispatchState(row_of_slot, weights, order, dropped=dropped,
                                                    real_tokens_per_expert=counts)
        # recv_counts[s, l]: rows source rank s sends to our local expert l.
        recv_counts = counts
        if self._comm:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(ep, e_loc)
        # The only host read of the layer: split sizes for the token all-to-all.
        send_splits, recv_splits = torch.stack(
            [counts.view(ep, e_loc).sum(1), recv_counts.sum(1)]).tolist()
        m = sum(recv_splits)
        recv = self._exchange(x_perm, m, recv_splits, send_splits)  # [M, d] by (source, expert)
        tokens_per_expert = recv_counts.sum(0)
        state = A2ADispatchState(row_of_slot, weights, order, dropped=dropped,
                                 real_tokens_per_expert=tokens_per_expert,
                                 send_splits=send_splits, recv_splits=recv_splits)
        local_expert = torch.arange(ep * e_loc, device=x.device) % e_loc
        seg = torch.repeat_interleave(local_expert, recv_counts.reshape(-1), output_size=m)
        state.regroup = torch.argsort(seg, stable=True)            # -> by (expert, source)
        state.regroup_inverse = torch.empty_like(state.regroup)
        state.regroup_inverse[state.regroup] = torch.arange(m, device=x.device)
        return permute_rows(recv, state.regroup, state.regroup_inverse), tokens_per_expert, state

    def _combine_dynamic(self, y_sorted, state):
        y_back = y_sorted                                          # EP=1: already slot rows
        if state.regroup is not None:                              # back to (source, expert)
            y_recv = permute_rows(y_sorted, state.regroup_inverse, state.regroup)
            y_back = self._exchange(y_recv, sum(state.send_splits), state.send_splits,
                                    state.recv_splits)             # [N*k, d] expert-major
        return combine_rows(y_back, state.row_of_slot, state.slot_of_row, state.weights)

    # ------------------------------------------------------------------ static
    def _dispatch_static(self, x, indices, weights):
        n, k = indices.shape
        ep, e_loc, e = self.ep_size, self.num_local_experts, self.num_experts
        cap = self.capacity(n, k)
        flat, order, counts = self._slot_order(indices)
        flat_sorted = flat[order]
        # Position of each sorted slot inside its expert's run; past C it is dropped.
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(order.numel(), device=x.device) - starts[flat_sorted]
        trash = e * cap                                            # one row past the buffer
        dest = torch.where(pos < cap, flat_sorted * cap + pos, torch.full_like(pos, trash))
        row_of_slot = torch.empty_like(dest)
        row_of_slot[order] = dest
        # slot_of_row: the slot filling each send-buffer row, n*k (a zero row) for padding.
        # Only dropped slots collide, all on the trash entry, which is cut off.
        slot_of_row = torch.full((trash + 1,), n * k, dtype=torch.int64, device=x.device)
        slot_of_row.scatter_(0, dest, order)
        slot_of_row = slot_of_row[:trash]
        send = dispatch_rows(x, row_of_slot, slot_of_row, k)      # [E*C, d] = [ep, E_loc, C]
        recv = self._exchange(send, trash, None, None)             # [ep(source), E_loc, C]
        # Fixed regroup to (local expert, source, slot): a transpose, no data dependence.
        d = x.shape[1]
        x_sorted = recv.view(ep, e_loc, cap, d).transpose(0, 1).reshape(trash, d)
        tokens_per_expert = torch.full((e_loc,), ep * cap, dtype=torch.int64, device=x.device)
        state = A2ADispatchState(row_of_slot, weights, slot_of_row,
                                 dropped=(counts - cap).clamp_min(0).sum(), capacity=cap)
        return x_sorted, tokens_per_expert, state

    def _combine_static(self, y_sorted, state):
        ep, e_loc, cap = self.ep_size, self.num_local_experts, state.capacity
        rows = e_loc * ep * cap
        d = y_sorted.shape[1]
        y_recv = y_sorted.view(e_loc, ep, cap, d).transpose(0, 1).reshape(rows, d)
        y_back = self._exchange(y_recv, rows, None, None)          # [E*C, d] expert-major
        # Dropped slots (row_of_slot == E*C) contribute exactly zero.
        return combine_rows(y_back, state.row_of_slot, state.slot_of_row, state.weights)
