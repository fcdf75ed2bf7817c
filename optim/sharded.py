"""Data-parallel sharded optimizer step (ZeRO-1): each DP rank keeps optimizer state only for
the part of the model it owns, updates that part, and shares the result.

* Muon needs whole matrices: each Muon matrix is owned by one rank of its DP group
  (``plan_muon_owners``: largest first to the least-loaded rank by numel).
* AdamW is elementwise: the AdamW parameters of one dtype are laid end to end in a flat
  buffer ``[N]`` padded to ``[W * S]`` (``W`` = DP size); rank ``r`` owns ``[r*S, (r+1)*S)``.

``step()`` takes each rank's un-scaled ``p.grad``, reduce-scatters the AdamW flat gradients and
reduces each Muon gradient to its owner (both to ``optim.grads``' convention: summed over the
copies, divided by the DP size), computes the global grad norm from the owned parts and clips
(``optim.grads``), updates the owned parts (torch's AdamW; Muon), then all-gathers the AdamW
shards and broadcasts each Muon matrix from its owner. Ownership, communication volume, memory
and the expert / pipeline cases are described in ``docs/optim_sharding.md``.

Low-precision weights (``param_dtype``, e.g. bf16; docs/memory.md, "Layouts"): the model's
weights are cast to ``param_dtype`` and the gradients accumulate in fp32 ``p.main_grad``
(``optim.main_grads``); this rank keeps fp32 main parameters only for what it owns (its AdamW
shards ``[S]`` and its Muon matrices), steps them in fp32, writes them rounded into its part of
the weights, and the all-gather / broadcast then shares the rounded weights.
``state_dtype`` (bf16) stores the AdamW moments and Muon momenta narrower; they are stepped in
fp32 and rounded on the store.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from .adamw_state import adamw_update
from .grads import GradGroups, clip_grads_, global_grad_norm, group_size, sum_of_squares
from .main_grads import MainGrads
from .main_params import cast_params_
from .muon import (TPShard, _batches, _check_matrix, apply_muon_updates, largest_first, muon_updates,
                   scratch_muon_updates, tp_shard)
from .param_groups import plan_param_groups
from .param_table import ParamEntry

__all__ = ["ShardedOptimizer", "plan_muon_owners"]

STATE_FORMAT = "k3train.sharded/1"
# torch 2.13 renamed the flat collectives; keep the old names for torch 2.8 .. 2.12.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def plan_muon_owners(numels: list[int], world: int) -> list[int]:
    """Group-local owner rank of each matrix (``numels[i]`` elements): largest first, each to
    the least-loaded rank. Ties break on table position and lowest rank, so every rank derives
    the same plan with no communication; max load <= min load + largest matrix."""
    load, owners = [0] * world, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owner = min(range(world), key=lambda r: (load[r], r))
        owners[i], load[owner] = owner, load[owner] + numels[i]
    return owners


@dataclass
class _Segment:
    """The part of one AdamW parameter inside this rank's shard: shard ``[lo, hi)`` holds the
    flattened parameter's ``[plo, plo + hi - lo)``."""
    param: torch.Tensor
    group: int
    lo: int
    hi: int
    plo: int


@dataclass
class _Bucket:
    """One dtype's AdamW parameters of one domain, flattened ``[N]`` and padded to ``[W*S]``."""
    params: list[torch.Tensor]
    shard: int  # S
    segments: list[_Segment]
    exp_avg: torch.Tensor  # [S] state dtype (fp32 or bf16), this rank's shard only
    exp_avg_sq: torch.Tensor  # [S] state dtype
    grad: torch.Tensor | None = None  # [S] averaged gradient of the shard, set by the reduce
    main: torch.Tensor | None = None  # [S] fp32 main parameters of the shard (low-precision weights)


@dataclass
class _Domain:
    """Parameters reduced and sharded over one group: "dense" (DP) or "expert" (expert DP)."""
    name: str
    group: Any
    world: int
    rank: int
    muon: list[tuple[ParamEntry, int, int]]  # (entry, param-group index, owner rank)
    buckets: list[_Bucket] = field(default_factory=list)
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)  # owned Muon matrices only
    mains: dict[str, torch.Tensor] = field(default_factory=dict)  # their fp32 main parameters

    def owned_muon(self) -> Iterable[tuple[ParamEntry, int]]:
        return ((e, g) for e, g, owner in self.muon if owner == self.rank)


def _group_info(group) -> tuple[int, int]:
    """(size, this rank's index) of ``group``; None is one rank (``GradGroups``' convention)."""
    if group_size(group) == 1:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class ShardedOptimizer:
    """ZeRO-1 optimizer over a parameter table; same surface as ``CombinedOptimizer``, plus the
    gradient methods of ``optim.grads.DataParallelGrads`` (it reduces gradients itself).

    table: the parameter table. Keywords: ``name`` "adamw" (every entry on AdamW) or "muon"
    (Muon entries on Muon with their per-head ``heads``, the rest on AdamW) and
    ``build_optimizer``'s hyper-parameters (``ns_steps``: Newton-Schulz iterations, ``ns_mode``:
    their form, ``optim.ns_gram``). ``groups``:
    the process groups (``GradGroups``; all None: one rank). AdamW entries and Muon matrices
    are sharded / owned over ``groups.dp``; entries whose name satisfies ``is_expert`` over
    ``groups.expert_dp`` instead (assuming, as in megatron-core's layout, that the DP group is
    the union of disjoint expert-DP groups each holding a different expert shard). Under
    context parallelism ``groups.dp`` is the DP x CP group (every rank of it holds the dense
    weights) and megatron-core's expert-DP group spans CP, so both shard over CP too. Gradients
    follow ``optim.grads``' convention: un-scaled per-rank ``p.grad`` in, the gradient of the
    DP-mean loss out (summed over the copies, divided by the DP size, experts included).
    The norm sums TP-shard squares over ``groups.tp`` and the total over ``groups.pp``.
    ``param_dtype``: None (the weights keep their dtype and are stepped in place), or the dtype
    the weights are cast to (bf16), with fp32 main parameters for the owned parts and fp32
    ``main_grad`` accumulation (module docstring). ``state_dtype``: the moments' dtype (None:
    fp32).
    """

    reduces_gradients = True  # the trainer must NOT all-reduce gradients over DP itself

    def __init__(self, table: list[ParamEntry], *, name: str = "adamw", lr: float,
                 weight_decay: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 muon_lr: float | None = None, muon_momentum: float = 0.95, ns_steps: int = 5,
                 ns_mode: str = "standard", groups: GradGroups = GradGroups(),
                 is_expert: Callable[[str], bool] | None = None,
                 param_dtype: torch.dtype | None = None, state_dtype: torch.dtype | None = None) -> None:
        plans = plan_param_groups(table, name, lr=lr, weight_decay=weight_decay, muon_lr=muon_lr)
        self.param_dtype, self.state_dtype = param_dtype, state_dtype or torch.float32
        self._state_dtype_given = state_dtype
        self.main = param_dtype is not None
        self.name, self.table, self.groups = name, list(table), groups
        self.betas, self.eps, self.muon_momentum, self.ns_steps = betas, eps, muon_momentum, ns_steps
        self.ns_mode = ns_mode  # Newton-Schulz form (optim.ns_gram)
        self._step, self._reduced, self._clipped, self._norm = 0, False, False, None

        # The shared groups (Muon first, then AdamW; one per (lr, wd) mult), params as tensors.
        self.param_groups = [{"params": [e.param for e in plan.entries], **plan.hyper()}
                             for plan in plans]
        index = {id(e): (gi, plan.kind == "muon") for gi, plan in enumerate(plans) for e in plan.entries}
        group_of = [index[id(e)][0] for e in self.table]  # param-group index of each entry
        use_muon = [index[id(e)][1] for e in self.table]
        for e, m in zip(self.table, use_muon):
            if m:
                _check_matrix(e.shape, e.heads, e.name)

        expert = [bool(is_expert and is_expert(e.name)) for e in self.table]
        self.domains: list[_Domain] = []
        for dname, group, want in (("dense", groups.dp, False), ("expert", groups.expert_dp, True)):
            picked = [i for i in range(len(self.table)) if expert[i] == want]
            if not picked:
                continue
            world, rank = _group_info(group)
            muon = [i for i in picked if use_muon[i]]
            owners = plan_muon_owners([self.table[i].param.numel() for i in muon], world)
            d = _Domain(dname, group, world, rank,
                        [(self.table[i], group_of[i], o) for i, o in zip(muon, owners)])
            for e, _ in d.owned_muon():
                if self.main:  # taken before the cast: an fp32 initialisation survives whole
                    # An fp32 weight's own storage (p.data: its own version counter); the
                    # cast below gives the weight a new bf16 one.
                    d.mains[e.name] = (e.param.data if e.param.dtype == torch.float32
                                       else e.param.detach().to(torch.float32))
                d.momentum[e.name] = torch.zeros_like(e.param, dtype=self.momentum_dtype(e.param))
            adamw = [i for i in picked if not use_muon[i]]
            dtype_of = {i: param_dtype or self.table[i].param.dtype for i in adamw}
            for dtype in dict.fromkeys(dtype_of.values()):
                d.buckets.append(self._bucket([i for i in adamw if dtype_of[i] == dtype],
                                              group_of, world, rank))
            self.domains.append(d)
        self.main_grads, self._main_slots = None, None
        if self.main:
            cast_params_([e.param for e in self.table], param_dtype)
            self.main_grads = MainGrads(params=[e.param for e in self.table])

    def momentum_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of a Muon momentum (the same on every rank, owner or not): ``state_dtype``
        if given, else fp32 with low-precision weights, else the parameter's."""
        if self._state_dtype_given is not None:
            return self._state_dtype_given
        return torch.float32 if self.main else p.dtype

    def _bucket(self, idx: list[int], group_of: list[int], world: int, rank: int) -> _Bucket:
        params = [self.table[i].param for i in idx]
        shard = -(-sum(p.numel() for p in params) // world)  # ceil: the last shard holds padding
        lo, hi, off, segments = rank * shard, (rank + 1) * shard, 0, []
        for i, p in zip(idx, params):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                segments.append(_Segment(p, group_of[i], a - lo, b - lo, a - off))
            off += p.numel()
        zeros = torch.zeros(shard, dtype=self.state_dtype, device=params[0].device)
        bucket = _Bucket(params, shard, segments, zeros, zeros.clone())
        if self.main:
            bucket.main = torch.zeros(shard, dtype=torch.float32, device=params[0].device)
            for s in segments:
                bucket.main[s.lo:s.hi].copy_(s.param.detach().reshape(-1)[s.plo:s.plo + s.hi - s.lo])
        return bucket

    # ---- where a parameter's gradient lives ----------------------------------------------------
    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gradient this step: ``p.grad``, or the fp32 ``p.main_grad`` (low-precision weights)."""
        return p.main_grad if self.main else p.grad

    def _zero_grad_if_none(self, p: torch.Tensor) -> torch.Tensor:
        if self.main:
            if p.main_grad is None:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return p.main_grad
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    # ---- gradients (optim.grads' convention and norm) ----------------------------------------
    def reduce_grads(self) -> None:
        """Reduce gradients into the owned parts: summed over the domain's group (reduce-scatter
        for AdamW buckets, reduce to the owner for Muon matrices), divided by the DP size.
        Idempotent until the next step."""
        if self._reduced:
            return
        works, keep = [], []
        for d in self.domains:
            for b in d.buckets:
                p0 = b.params[0]
                dtype = torch.float32 if self.main else p0.dtype
                flat = torch.zeros(b.shard * d.world, dtype=dtype, device=p0.device)
                off = 0
                for p in b.params:  # a missing grad counts as zero (see the docs' caveats)
                    g = self._grad(p)
                    if g is not None:
                        flat[off:off + p.numel()].copy_(g.reshape(-1))
                    off += p.numel()
                if d.world == 1:
                    b.grad = flat
                    continue
                b.grad = torch.empty(b.shard, dtype=flat.dtype, device=flat.device)
                keep.append(flat)  # must outlive the async collective
                works.append(_reduce_scatter(b.grad, flat, group=d.group, async_op=True))
            for e, _, owner in d.muon:
                g = self._zero_grad_if_none(e.param)
                if d.world > 1:
                    # In place: only the owner's p.grad is meaningful afterwards.
                    works.append(dist.reduce(g, group_dst=owner, group=d.group, async_op=True))
        for w in works:
            w.wait()
        dp = self.groups.loss_ranks  # gloo has no AVG: sum, then divide
        if dp > 1:
            for d in self.domains:
                for b in d.buckets:
                    b.grad.div_(dp)
                for e, _ in d.owned_muon():
                    self._grad(e.param).div_(dp)
        self._reduced = True

    def _owned_grads(self) -> Iterable[tuple[torch.Tensor, torch.Tensor, bool]]:
        """(reduced gradient view, its parameter, is expert) for every part this rank owns."""
        for d in self.domains:
            for b in d.buckets:
                for s in b.segments:
                    yield b.grad[s.lo:s.hi], s.param, d.name == "expert"
            for e, _ in d.owned_muon():
                yield self._grad(e.param), e.param, d.name == "expert"

    def grad_norm_sq_local(self) -> torch.Tensor:
        """Squared L2 norm (0-dim fp32) of the reduced gradient over the parts this rank owns.
        Reduces the gradients first. Summed over the DP group it gives the stage's squared norm."""
        self.reduce_grads()
        return sum_of_squares([g for g, _, _ in self._owned_grads()], self.table[0].param.device)

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm (0-dim fp32) of the reduced gradient of the whole model
        (``optim.grads.global_grad_norm`` over the owned parts). Reduces the gradients first;
        computed once per step (collectives), then cached until ``step``/``zero_grad``."""
        self.reduce_grads()
        if self._norm is None:
            self._norm = global_grad_norm(self._owned_grads(), groups=self.groups, sharded_over_dp=True)
        return self._norm

    def clip_grads_(self, norm: torch.Tensor, max_norm: float | None) -> None:
        """Scale the owned gradients by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grads_``);
        ``step()`` then does not clip again."""
        self.reduce_grads()
        # The AdamW shard buffers whole (their padding is zero) and the owned Muon gradients.
        owned = [b.grad for d in self.domains for b in d.buckets]
        owned += [self._grad(e.param) for d in self.domains for e, _ in d.owned_muon()]
        clip_grads_(owned, norm, max_norm)
        self._clipped = True

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Reduce gradients, compute the global norm and clip the owned gradients to
        ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``), with no host sync. Returns the
        norm before clipping. The next ``step()`` does not clip again."""
        norm = self.global_grad_norm()
        if not self._clipped:
            self.clip_grads_(norm, max_norm)
        return norm

    # ---- update ----------------------------------------------------------------------------
    def _muon_batches(self, d: "_Domain") -> list[tuple[int, int | None, TPShard | None, list]]:
        """``(group index, heads, TP split, entries)`` per Newton-Schulz call over the matrices
        this rank owns in domain ``d``: batched by group, shape, head split, TP split and dtypes
        as in Muon.step. A matrix split over TP (``optim.muon.tp_shard`` over ``groups.tp``) is
        gathered and orthogonalised whole; its TP peers own it too (the same plan from the same
        shard shapes) and reach the same batch in the same order."""
        same: dict[tuple, list] = {}
        for e, gi in d.owned_muon():
            p = d.mains.get(e.name, e.param)  # what is stepped: the main parameter, if any
            tp = tp_shard(e.param, e.heads, self.groups.tp)
            same.setdefault((gi, tuple(p.shape), e.heads, tp, p.dtype, d.momentum[e.name].dtype), []).append(e)
        return [(gi, heads, tp, es)
                for (gi, _shape, heads, tp, *_), entries in largest_first(same, lambda e: e.param.numel())
                for es in _batches(entries, entries[0].param.numel() * (tp.world if tp else 1))]

    @torch.no_grad()
    def warm_kernels(self) -> None:
        """Launch the Muon kernels of the next ``step()`` on scratch tensors of every shape and
        batch this rank will orthogonalise; nothing of the optimizer or model changes (see
        ``optim.muon.scratch_muon_updates``). AdamW shards run torch kernels only."""
        for d in self.domains:
            for gi, heads, tp, es in self._muon_batches(d):
                # Templates only (shape, dtype): the main parameter stands in for its fp32 gradient.
                grads = [d.mains[e.name] if self.main else e.param.grad for e in es]
                scratch_muon_updates(grads, [d.momentum[e.name] for e in es],
                                     momentum=self.muon_momentum, nesterov=True, heads=heads,
                                     ns_steps=self.ns_steps, alpha=-self.param_groups[gi]["lr"],
                                     ns_mode=self.ns_mode, tp=tp and tp.scratch())

    @torch.no_grad()
    def step(self, max_grad_norm: float | None = None) -> torch.Tensor:
        """Reduce, (clip,) update the owned parts, share them. Returns the global grad norm
        (0-dim fp32, before clipping)."""
        norm = self.clip_grad_norm_(max_grad_norm)
        self._step += 1
        beta1, beta2 = self.betas
        for d in self.domains:
            for b in d.buckets:
                self._adamw_shard(b, beta1, beta2)
            for gi, heads, tp, es in self._muon_batches(d):
                lr, wd = self.param_groups[gi]["lr"], self.param_groups[gi]["weight_decay"]
                ps = [d.mains[e.name] if self.main else e.param for e in es]
                updates = muon_updates([self._grad(e.param) for e in es], [d.momentum[e.name] for e in es],
                                       momentum=self.muon_momentum, nesterov=True, heads=heads,
                                       ns_steps=self.ns_steps, alpha=-lr, ns_mode=self.ns_mode, tp=tp)
                apply_muon_updates(ps, updates, 1.0 - lr * wd)
                if self.main:  # the owner's weight, rounded; the broadcast shares it
                    for e, main in zip(es, ps):
                        e.param.detach().copy_(main)
        self._share_params()
        for d in self.domains:
            for b in d.buckets:
                b.grad = None
        self._reduced, self._clipped, self._norm = False, False, None
        return norm

    def _adamw_shard(self, b: _Bucket, beta1: float, beta2: float) -> None:
        """torch's AdamW (``torch.optim.adamw.adamw``, the update ``build_optimizer``'s AdamW
        runs; ``optim.adamw_state.adamw_update``) on this rank's segments of one bucket, one call
        per param group, in fp32 (at least): the fp32 main parameters where the weights are
        low-precision, else the weights (a bf16 one in an fp32 copy written back); moments
        narrower than fp32 are widened for the update and rounded on the store."""
        by_group: dict[int, list[_Segment]] = {}
        for s in b.segments:
            by_group.setdefault(s.group, []).append(s)
        for gi, segments in by_group.items():
            views = [s.param.detach().view(-1)[s.plo:s.plo + s.hi - s.lo] for s in segments]
            if self.main:
                params = [b.main[s.lo:s.hi] for s in segments]
            else:
                params = [v.float() for v in views]  # the views themselves when fp32
            adamw_update(
                params, [b.grad[s.lo:s.hi].to(params[0].dtype) for s in segments],
                [b.exp_avg[s.lo:s.hi] for s in segments], [b.exp_avg_sq[s.lo:s.hi] for s in segments],
                [torch.tensor(float(self._step - 1)) for _ in segments],  # +1 inside
                beta1=beta1, beta2=beta2, lr=self.param_groups[gi]["lr"],
                weight_decay=self.param_groups[gi]["weight_decay"], eps=self.eps)
            for v, p in zip(views, params):
                if p.data_ptr() != v.data_ptr():
                    v.copy_(p)

    @torch.no_grad()
    def _write_weights_from_mains(self) -> None:
        """Round this rank's main parameters into its parts of the weights."""
        for d in self.domains:
            for b in d.buckets:
                for s in b.segments:
                    s.param.detach().view(-1)[s.plo:s.plo + s.hi - s.lo].copy_(b.main[s.lo:s.hi])
            for e, _ in d.owned_muon():
                e.param.detach().copy_(d.mains[e.name])

    @torch.no_grad()
    def load_main_params(self, values: dict[int, torch.Tensor]) -> None:
        """Set the owned main parameters from ``{id(model parameter): whole fp32 value}`` (every
        parameter of the table that has an entry) and the weights (rounded) from the same values;
        no communication: every rank passes the values of all its parameters (one call for all,
        or one per parameter as a checkpoint is read: each call touches only its entries)."""
        if self._main_slots is None:  # {id(param): [(param, main tensor, lo, hi, plo)]}, built once
            self._main_slots = {id(e.param): [(e.param, None, 0, 0, 0)] for e in self.table}
            for d in self.domains:
                for b in d.buckets:
                    for s in b.segments:
                        self._main_slots[id(s.param)].append((s.param, b.main, s.lo, s.hi, s.plo))
                for e, _ in d.owned_muon():
                    self._main_slots[id(e.param)].append((e.param, d.mains[e.name], 0, None, 0))
        for pid, value in values.items():
            for param, main, lo, hi, plo in self._main_slots.get(pid, ()):
                if main is None:  # the weight itself, rounded
                    param.detach().copy_(value)
                elif hi is None:  # an owned Muon matrix, whole
                    main.copy_(value)
                else:
                    main[lo:hi].copy_(value.reshape(-1)[plo:plo + hi - lo])

    def _share_params(self) -> None:
        """All-gather the AdamW shards and broadcast each Muon matrix from its owner."""
        works, gathered = [], []
        for d in self.domains:
            if d.world == 1:
                continue
            for b in d.buckets:
                p0 = b.params[0]
                local = torch.zeros(b.shard, dtype=p0.dtype, device=p0.device)
                for s in b.segments:
                    local[s.lo:s.hi].copy_(s.param.detach().view(-1)[s.plo:s.plo + s.hi - s.lo])
                full = torch.empty(b.shard * d.world, dtype=p0.dtype, device=p0.device)
                works.append(_all_gather(full, local, group=d.group, async_op=True))
                gathered.append((b, full, local))
            for e, _, owner in d.muon:
                works.append(dist.broadcast(e.param.detach(), group_src=owner, group=d.group,
                                            async_op=True))
        for w in works:
            w.wait()
        for b, full, _ in gathered:
            off = 0
            for p in b.params:
                p.detach().view(-1).copy_(full[off:off + p.numel()])
                off += p.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.main_grads is not None:
            self.main_grads.clear()
        for e in self.table:
            if set_to_none:
                e.param.grad = None
            elif e.param.grad is not None:
                e.param.grad.zero_()
        for d in self.domains:
            for b in d.buckets:
                b.grad = None
        self._reduced, self._clipped, self._norm = False, False, None

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (AdamW moments of its shards, Muon
        momenta of its matrices): about 1/W of the unsharded optimizer's."""
        tensors = [t for d in self.domains for b in d.buckets for t in (b.exp_avg, b.exp_avg_sq)]
        tensors += [t for d in self.domains for t in d.momentum.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def main_bytes(self) -> int:
        """Bytes of fp32 main parameters held by this rank (0 when the weights are stepped in
        place): its AdamW shards and owned Muon matrices, about 4/W bytes per parameter."""
        tensors = [b.main for d in self.domains for b in d.buckets if b.main is not None]
        tensors += [t for d in self.domains for t in d.mains.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- checkpoints -----------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        return {
            "dp_size": {d.name: d.world for d in self.domains},
            "dp_rank": {d.name: d.rank for d in self.domains},
            "table": [(e.name, e.shape, str(e.param.dtype)) for e in self.table],
            "muon_owners": {d.name: [(e.name, o) for e, _, o in d.muon] for d in self.domains},
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: its shards' moments, its Muon momenta, the step, the groups'
        hyper-parameters and the layout (DP sizes, ranks, table fingerprint, ownership)."""
        return {
            "format": STATE_FORMAT, "optimizer": self.name, "step": self._step,
            "layout": self._layout(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "adamw": {d.name: [{"exp_avg": b.exp_avg.clone(), "exp_avg_sq": b.exp_avg_sq.clone()}
                               for b in d.buckets] for d in self.domains},
            "muon": {n: t.clone() for d in self.domains for n, t in d.momentum.items()},
            "main": ({d.name: [b.main.clone() for b in d.buckets] for d in self.domains},
                     {n: t.clone() for d in self.domains for n, t in d.mains.items()}) if self.main else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a ``state_dict`` saved by the same rank of the same layout; raise naming the
        first mismatch otherwise (resharding to another DP size is not supported)."""
        if state.get("format") != STATE_FORMAT or state.get("optimizer") != self.name:
            raise ValueError(f"optimizer state is {state.get('format')}/{state.get('optimizer')}, "
                             f"this optimizer is {STATE_FORMAT}/{self.name}")
        saved, mine = state["layout"], self._layout()
        for d in self.domains:
            size = saved["dp_size"].get(d.name)
            if size != d.world:
                raise ValueError(f"DP size mismatch for {d.name} parameters: the state was saved "
                                 f"with dp_size={size}, this optimizer has dp_size={d.world}")
        if saved["dp_size"] != mine["dp_size"] or saved["dp_rank"] != mine["dp_rank"]:
            raise ValueError(f"DP layout mismatch: state saved by ranks {saved['dp_rank']} of "
                             f"{saved['dp_size']}, this is {mine['dp_rank']} of {mine['dp_size']}")
        a, b = ([(n, tuple(shape), dt) for n, shape, dt in t] for t in (saved["table"], mine["table"]))
        bad = next((i for i in range(max(len(a), len(b))) if a[i:i + 1] != b[i:i + 1]), None)
        if bad is not None:
            raise ValueError(f"parameter table mismatch at entry {bad}: saved {a[bad:bad + 1]}, "
                             f"here {b[bad:bad + 1]}")
        if saved["muon_owners"] != mine["muon_owners"]:
            raise ValueError("Muon ownership plan mismatch (different optimizer name or rules)")
        if len(state["param_groups"]) != len(self.param_groups):
            raise ValueError(f"state has {len(state['param_groups'])} param groups, "
                             f"this optimizer has {len(self.param_groups)}")
        for d in self.domains:
            for bucket, sd in zip(d.buckets, state["adamw"][d.name]):
                bucket.exp_avg.copy_(sd["exp_avg"])
                bucket.exp_avg_sq.copy_(sd["exp_avg_sq"])
            for n, t in d.momentum.items():
                t.copy_(state["muon"][n])
        if self.main:
            if state.get("main") is None:
                raise ValueError("optimizer state has no fp32 main parameters (saved with weights "
                                 "stepped in place); load it through the checkpoint's tensors instead")
            buckets, mains = state["main"]
            for d in self.domains:
                for bucket, saved in zip(d.buckets, buckets[d.name]):
                    bucket.main.copy_(saved)
                for n, t in d.mains.items():
                    t.copy_(mains[n])
            self._write_weights_from_mains()
            self._share_params()
        for group, saved_group in zip(self.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self._step = state["step"]

    def __repr__(self) -> str:
        return "ShardedOptimizer({}; {})".format(self.name, ", ".join(
            f"{d.name}: W={d.world}, {len(d.muon)} Muon" for d in self.domains))
