"""Muon with Newton-Schulz run once per matrix block across the ranks that hold copies of it.

The replicated Muon (``optim.muon.Muon`` after ``optim.grads.DataParallelGrads``) has every
data-parallel rank orthogonalise every matrix it holds: the same iteration on the same reduced
gradient, repeated on each of the group's ``W`` ranks. ``DistributedMuon`` splits that work:

* Units are Newton-Schulz blocks: a 2-D matrix is one block ``[A, B]``, a per-head matrix
  ``H`` blocks ``[A/H, B]``, a routed-expert stack ``[S, A, B]`` its ``S`` matrices.
* Each block has one owner in the group its parameter is replicated over (dense weights: the
  data-parallel group, with the context-parallel ranks under CP; routed experts: the
  expert-data-parallel group, which spans CP), chosen by
  ``plan_ns_owners``: largest Newton-Schulz FLOPs first, each to the least-loaded rank, ties by
  position and lowest rank. Every rank derives the same plan from the same parameter list.
* Every rank advances the momentum of every matrix (elementwise, cheap; the state stays
  replicated, so a checkpoint is the replicated Muon's and resumes with either). Only the owner
  orthogonalises a block, batched per (param group, block shape) as the replicated step
  batches, writing ``-lr * scale * O`` into its slice of a flat buffer.
* One all-gather per group (and Newton-Schulz dtype) per step shares the flat buffers, each
  padded to the longest rank's; every rank then applies ``p = (1 - lr wd) p + u`` itself.
  Where the group's Muon parameters exceed ``_ROUND_ELEMS`` (512 MiB of bf16) the step goes in
  rounds of whole parameters, one all-gather each, so the transient buffers (owned inputs,
  gathered updates) stay bounded as the replicated step's batches are.
* A parameter no other rank holds (a one-rank group: DP=1, or experts at EP = DP) steps exactly
  as in ``Muon`` (same batches, same memory).
* Under tensor parallelism (``tp_group``) a block split over TP ranks (``optim.muon.tp_shard``)
  is orthogonalised whole by the owner slot: the owner and its TP peers (which derive the same
  plan from the same shard shapes, hence own the same blocks in the same batches) all-gather
  their slices over TP, run the iteration on the whole block and keep their own slice, which the
  DP all-gather then shares as before.

Same arithmetic per block as ``Muon.step`` (``momentum_input``, ``newton_schulz`` with the same
``out_scale``, ``apply_muon_updates``), so the update equals the replicated one; only the batch
a block is stacked in differs. Cost per rank: Newton-Schulz FLOPs ``~1/W`` (``ns_flops_per_rank``),
plus an all-gather of the updates (``gather_bytes``: ``(W - 1) * L_max`` elements received,
``L_max`` the longest rank's share).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from .grads import group_size
from .muon import (Muon, TPShard, _batches, _ns_dtype, apply_muon_updates, gather_tp_blocks,
                   largest_first, momentum_input, muon_scale, newton_schulz, ns_flops, tp_shard,
                   tp_slice)

__all__ = ["DistributedMuon", "gather_bytes", "muon_blocks", "ns_flops_per_rank", "plan_ns_owners"]

# torch 2.13 renamed the flat all-gather; keep the old name for torch 2.8 .. 2.12.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def muon_blocks(shape: tuple[int, ...], heads: int | None) -> tuple[int, int, int]:
    """``(n, rows, cols)``: the ``n`` Newton-Schulz blocks ``[rows, cols]`` of a Muon parameter
    of ``shape`` (``[A, B]`` or ``[S, A, B]``) split into ``heads`` row blocks (2-D only)."""
    *stack, rows, cols = shape
    h = heads or 1
    return (stack[0] if stack else 1) * h, rows // h, cols


def plan_ns_owners(costs: list[int], world: int) -> list[int]:
    """Group-local owner rank of each block (``costs[i]``: its Newton-Schulz FLOPs): largest
    first, each to the least-loaded rank (ties: earlier block first, lowest rank). Deterministic,
    so every rank derives the same plan; max load <= min load + the largest block."""
    heap = [(0, r) for r in range(world)]
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


def ns_flops_per_rank(matrices: Iterable[tuple[tuple[int, ...], int | None]], world: int, *,
                      steps: int = 5, distributed: bool = True) -> list[int]:
    """Newton-Schulz FLOPs each of ``world`` ranks runs per step for Muon parameters given as
    ``(shape, heads)``, all replicated over one group of ``world`` ranks: the whole total on
    every rank (replicated), or each rank's owned blocks under ``plan_ns_owners``."""
    costs: list[int] = []
    for shape, heads in matrices:
        n, rows, cols = muon_blocks(tuple(shape), heads)
        costs += [ns_flops(rows, cols, steps)] * n
    if not distributed:
        return [sum(costs)] * world
    load = [0] * world
    for c, o in zip(costs, plan_ns_owners(costs, world)):
        load[o] += c
    return load


def gather_bytes(matrices: Iterable[tuple[tuple[int, ...], int | None]], world: int, *,
                 element_size: int, steps: int = 5) -> int:
    """Bytes one rank receives per step in the all-gathers of updates for Muon parameters
    ``(shape, heads)`` (in the optimizer's order) replicated over ``world`` ranks: per round,
    ``(W - 1) * L_max`` elements of ``element_size`` bytes (``L_max``: the longest rank's share
    of the round, padding included)."""
    if world == 1:
        return 0
    items = [_Item(0, None, *muon_blocks(tuple(shape), heads)) for shape, heads in matrices]
    if not items:
        return 0
    return sum((world - 1) * rnd.length for rnd in _rounds(items, world, 0, steps)) * element_size


@dataclass
class _Item:
    """One Muon parameter with a gradient, viewed as ``n`` blocks ``[rows, cols]``."""
    group: int  # param-group index
    param: torch.Tensor | None  # None: accounting only (gather_bytes)
    n: int
    rows: int
    cols: int
    owners: list[int] = field(default_factory=list)  # per block
    tp: TPShard | None = None  # blocks split over TP: rows, cols are this rank's slice

    @property
    def numel(self) -> int:
        return self.n * self.rows * self.cols

    @property
    def whole(self) -> tuple[int, int]:
        """A block's whole ``(rows, cols)`` (the slice's, times the TP size along the split)."""
        if self.tp is None:
            return self.rows, self.cols
        w = self.tp.world
        return (self.rows * w, self.cols) if self.tp.dim == -2 else (self.rows, self.cols * w)


@dataclass
class _Run:
    """Blocks ``idx`` (in index order) of one item, owned by one rank, stored at
    ``[off, off + len(idx) * rows * cols)`` of the round's gathered buffer."""
    off: int
    idx: list[int]


@dataclass
class _Round:
    """Whole items whose updates travel in one all-gather of ``world * length`` elements."""
    items: list[int]
    length: int  # L_max: every rank's send buffer, padded
    # Batches this rank orthogonalises: (param group, rows, cols, TP split, [(item, owned block idx)]).
    mine: list[tuple[int, int, int, TPShard | None, list[tuple[int, list[int]]]]]
    runs: dict[int, list[_Run]]  # per item: where its blocks lie in the gathered buffer


# Items per all-gather are capped at this many elements (512 MiB in bf16): bounds the transient
# buffers (owned inputs, the gathered updates) as the replicated step's batch cap does.
_ROUND_ELEMS = 1 << 28


def _rounds(items: list[_Item], world: int, rank: int, steps: int) -> list[_Round]:
    """Owners for every block of ``items`` (one plan over all of them), then the items cut into
    rounds of at most ``_ROUND_ELEMS`` elements (an item larger than that alone)."""
    costs = [ns_flops(*it.whole, steps) for it in items for _ in range(it.n)]
    flat = plan_ns_owners(costs, world)
    k = 0
    for it in items:
        it.owners, k = flat[k:k + it.n], k + it.n
    cuts: list[list[int]] = [[]]
    size = 0
    for i, it in enumerate(items):
        if cuts[-1] and size + it.numel > _ROUND_ELEMS:
            cuts.append([])
            size = 0
        cuts[-1].append(i)
        size += it.numel
    return [_round(items, idx, world, rank) for idx in cuts]


def _round(items: list[_Item], idx: list[int], world: int, rank: int) -> _Round:
    # Each rank's share, batched by (param group, block shape) in the replicated step's order
    # (largest total first); blocks of one item stay in index order within a batch.
    keyed: dict[tuple[int, int, int, TPShard | None], list[int]] = {}
    for i in idx:
        it = items[i]
        keyed.setdefault((it.group, it.rows, it.cols, it.tp), []).append(i)
    order = largest_first(keyed, lambda i: items[i].numel)
    runs: dict[int, list[_Run]] = {i: [] for i in idx}
    mine, ends = [], []
    for r in range(world):
        off = 0
        for (gi, rows, cols, tp), same in order:
            batch = [(i, [b for b in range(items[i].n) if items[i].owners[b] == r]) for i in same]
            batch = [(i, bs) for i, bs in batch if bs]
            for i, bs in batch:
                runs[i].append(_Run(off, bs))
                off += len(bs) * rows * cols
            if r == rank and batch:
                mine.append((gi, rows, cols, tp, batch))
        ends.append(off)
    length = max(ends)
    # Offsets so far are within each rank's share: shift rank r's by r * L_max (the gathered
    # buffer is the W send buffers end to end).
    for i in idx:
        for run in runs[i]:
            run.off += items[i].owners[run.idx[0]] * length
    return _Round(idx, length, mine, runs)


class DistributedMuon(Muon):
    """``Muon`` whose Newton-Schulz work is split over the ranks holding copies of each matrix
    (see the module docstring); the update equals ``Muon``'s.

    group_of: the process group a parameter's copies live on (dense: the data-parallel group;
    routed experts: the expert-data-parallel group); None or a one-rank group: this rank alone,
    which steps exactly as ``Muon`` (same batches, same memory). Gradients must already be
    reduced (``optim.grads.DataParallelGrads``), so every rank of a group holds the same
    ``p.grad`` and the same set of parameters with a gradient. Other arguments as ``Muon``;
    state and checkpoints are ``Muon``'s (``state_kind``).
    """

    state_kind = "Muon"  # checkpoints interchange with the replicated Muon

    def __init__(self, params: Iterable[Any], *, group_of: Callable[[torch.Tensor], Any], **kwargs) -> None:
        super().__init__(params, **kwargs)
        self._group_of = group_of
        self._plans: dict[tuple, list[_Round]] = {}

    def _domains(self) -> tuple[set[int], list[tuple[Any, torch.dtype, list[_Item]]]]:
        """Ids of the parameters with a gradient that no other rank holds, and ``(group,
        Newton-Schulz dtype, items)`` for the rest, in param-group and parameter order (the
        same on every rank of a group)."""
        alone: set[int] = set()
        out: dict[tuple[int, torch.dtype], tuple[Any, torch.dtype, list[_Item]]] = {}
        for gi, group in enumerate(self.param_groups):
            for p, _name, heads in self._per_param(group):
                if p.grad is None:
                    continue
                pg = self._group_of(p)
                if group_size(pg) == 1:
                    alone.add(id(p))
                    continue
                dtype = _ns_dtype(p.grad)
                n, rows, cols = muon_blocks(tuple(p.shape), heads)
                out.setdefault((id(pg), dtype), (pg, dtype, []))[2].append(
                    _Item(gi, p, n, rows, cols, tp=tp_shard(p, heads, self._tp_group)))
        return alone, list(out.values())

    def _plan(self, pg, dtype: torch.dtype, items: list[_Item]) -> tuple[list[_Item], list[_Round]]:
        """The rounds for these items, cached while the same parameters have gradients."""
        steps = max(self.param_groups[it.group]["ns_steps"] for it in items)
        key = (id(pg), dtype, steps, tuple((it.group, id(it.param), it.n, it.rows) for it in items))
        if key not in self._plans:
            self._plans[key] = (items, _rounds(items, group_size(pg), dist.get_rank(pg), steps))
        return self._plans[key]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        alone, domains = self._domains()
        if alone:
            for group in self.param_groups:
                self._step_group(group, alone)
        for pg, dtype, items in domains:
            items, rounds = self._plan(pg, dtype, items)
            rank = dist.get_rank(pg)
            for rnd in rounds:
                self._step_round(pg, dtype, rank, items, rnd)
        return loss

    def _step_round(self, pg, dtype: torch.dtype, rank: int, items: list[_Item], rnd: _Round) -> None:
        world = group_size(pg)
        device = items[rnd.items[0]].param.device
        # 1. Momentum on every rank (replicated state); keep the Newton-Schulz input of the
        #    blocks this rank owns.
        owned: dict[int, torch.Tensor] = {}
        for i in rnd.items:
            it = items[i]
            p, group = it.param, self.param_groups[it.group]
            u = torch.empty(p.shape, dtype=dtype, device=device)
            momentum_input(p.grad, self.momentum_buffer(p, group), u, momentum=group["momentum"],
                           nesterov=group["nesterov"])
            mine = [b for b, o in enumerate(it.owners) if o == rank]
            if mine:
                u = u.view(it.n, it.rows, it.cols)
                owned[i] = u if len(mine) == it.n else u[torch.tensor(mine, device=device)]
        # 2. Newton-Schulz on the owned blocks, written into this rank's send buffer.
        send = torch.zeros(rnd.length, dtype=dtype, device=device)
        off = 0
        for gi, rows, cols, tp, batch in rnd.mine:
            group = self.param_groups[gi]
            stack = torch.cat([owned.pop(i) for i, _ in batch]) if len(batch) > 1 else owned.pop(batch[0][0])
            # TP-split blocks: this rank and its TP peers gather, orthogonalise and scale whole
            # blocks (the same batches on each: they own the same blocks), each keeping its slice.
            for chunk in _batches(list(range(stack.shape[0])), rows * cols * (tp.world if tp else 1)):
                lo, hi = chunk[0], chunk[-1] + 1
                blocks = stack[lo:hi] if tp is None else gather_tp_blocks(stack[lo:hi], tp)
                out = newton_schulz(blocks, group["ns_steps"], mode=self.ns_mode,
                                    out_scale=-group["lr"] * muon_scale(*blocks.shape[-2:]))
                if tp is not None:
                    out = tp_slice(out, tp)
                send[off + lo * rows * cols:off + hi * rows * cols].view(hi - lo, rows, cols).copy_(out)
            off += stack.shape[0] * rows * cols
            del stack
        # 3. One all-gather shares every rank's updates.
        full = torch.empty(world * rnd.length, dtype=dtype, device=device)
        _all_gather(full, send, group=pg)
        del send
        # 4. Every rank applies every update: p = (1 - lr wd) p + u.
        for i in rnd.items:
            it, runs = items[i], rnd.runs[i]
            group, size = self.param_groups[it.group], it.rows * it.cols
            if len(runs) == 1:  # one owner holds every block, in order
                upd = full[runs[0].off:runs[0].off + it.numel].view(it.param.shape)
            else:
                upd = torch.empty((it.n, size), dtype=dtype, device=device)
                for run in runs:
                    idx = torch.tensor(run.idx, device=device)
                    upd.index_copy_(0, idx, full[run.off:run.off + len(run.idx) * size].view(-1, size))
                upd = upd.view(it.param.shape)
            apply_muon_updates([it.param], [upd], 1.0 - group["lr"] * group["weight_decay"])
