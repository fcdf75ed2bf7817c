"""The one gradient path: reduction over data parallelism, the global grad norm and clipping.

Both optimizers go through this module. The replicated optimizer (``build_optimizer``) has its
gradients reduced by ``DataParallelGrads`` (all-reduce: every rank keeps whole gradients); the
ZeRO-1 ``ShardedOptimizer`` reduces them itself (reduce-scatter / reduce to the owner: each rank
keeps the parts it owns) with the same divisor (``loss_ranks``). Both compute the norm with
``global_grad_norm`` and clip with ``clip_grads_``, and both expose ``reduce_grads()``,
``global_grad_norm()`` and ``clip_grads_(norm, max_norm)``, so the trainer has one step for both.

Gradient convention (dense and routed-expert parameters alike)
--------------------------------------------------------------
The training loss is the mean, over the ``dp`` data-parallel ranks, of each rank's loss on its
own tokens.

* Before reduction, a rank's ``p.grad`` is the gradient of *its own* loss, as backward left it.
  For a dense parameter that comes from the rank's tokens. For a routed-expert shard (the
  experts this rank holds in its expert-parallel group) it comes from every token routed to
  those experts, which the EP all-to-all brought from all ranks of the EP group. No rank
  pre-scales anything.
* After reduction, ``p.grad`` (ZeRO-1: the part the rank owns) is the gradient of the training
  loss: the sum of the per-rank gradients over the ranks that hold a copy of the parameter,
  divided by ``dp``. For dense parameters the copies are the DP group, so this is the DP mean.
  For expert shards the copies are the expert-DP group (the ranks holding the same shard, one
  per EP group); since EP x expert-DP = DP (megatron-core's layout, EP inside DP), that sum
  reaches every DP rank's tokens exactly once, and the divisor is again ``dp``, not the
  expert-DP size.

Norm: the L2 norm of the reduced gradient of the whole model, each element counted once:
tensor-parallel shards (``tensor_model_parallel``) summed over TP, expert shards over EP
(ZeRO-1: over DP, which spans EP, because the owned parts are disjoint across DP), pipeline
stages over PP. Clip: ``g *= min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_``, on device (no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["GradGroups", "DataParallelGrads", "allreduce_mean", "allreduce_sum_then_scale",
           "clip_grads_", "global_grad_norm", "group_size", "is_tp_sharded", "sum_of_squares"]


@dataclass(frozen=True, kw_only=True)
class GradGroups:
    """The process groups a step's gradients are reduced and normed over. None: that kind of
    parallelism is absent (one rank), whether or not ``torch.distributed`` is initialised.

    dp: data-parallel ranks; the loss is their mean, dense gradients are reduced over them.
    expert_dp: the ranks holding the same routed-expert shard; expert gradients are reduced
        over them (still divided by the size of ``dp``: see the module docstring).
    tp: tensor-parallel ranks; squares of TP shards are summed over them.
    ep: expert-parallel ranks (each holds other experts); squares of whole expert gradients
        are summed over them.
    pp: pipeline ranks (each stage holds other layers); the squared norm is summed over them.
    """

    dp: Any = None
    expert_dp: Any = None
    tp: Any = None
    ep: Any = None
    pp: Any = None

    def __post_init__(self) -> None:
        dp, edp = group_size(self.dp), group_size(self.expert_dp)
        if dp % edp:
            # Expert gradients are divided by the DP size: their copies must be DP ranks.
            raise ValueError(f"GradGroups: expert_dp has {edp} ranks, which does not divide dp's "
                             f"{dp}; the expert-DP group must lie inside the DP group")

    @property
    def loss_ranks(self) -> int:
        """The divisor of every reduced gradient: the number of ranks whose losses are averaged."""
        return group_size(self.dp)


def group_size(group) -> int:
    """Ranks in ``group``; 1 for None or without ``torch.distributed``."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def is_tp_sharded(p: torch.Tensor) -> bool:
    """megatron-core marks sharded weights with ``tensor_model_parallel``; we mark our own too."""
    return bool(getattr(p, "tensor_model_parallel", False))


# ---- reduction ------------------------------------------------------------------------------
def allreduce_mean(tensors: list[torch.Tensor], group, world: int) -> None:
    """Average ``tensors`` in place over ``group`` with one collective per dtype bucket."""
    if world == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = _flatten_dense_tensors(group_tensors)
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for t, synced in zip(group_tensors, _unflatten_dense_tensors(flat, group_tensors)):
            t.copy_(synced)


def allreduce_sum_then_scale(tensors: list[torch.Tensor], group, scale: float) -> None:
    """Sum ``tensors`` over ``group`` and multiply by ``scale`` (expert gradients: summed over
    the expert-data-parallel replicas, divided by the full data-parallel size)."""
    if not tensors:
        return
    if group_size(group) == 1:
        # Nothing to sum: scale in place (flattening all expert gradients into one buffer and
        # back is a full copy of them for a multiply by 1).
        if scale != 1.0:
            torch._foreach_mul_(tensors, scale)
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


# ---- norm and clip --------------------------------------------------------------------------
def sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """sum_i ||t_i||^2 in fp32 as a 0-dim tensor: one foreach norm for the whole list rather than
    a few kernels per tensor (a step has hundreds of parameters; launches dominated)."""
    if not tensors:
        return torch.zeros((), device=device, dtype=torch.float32)
    # fp64 gradients (reference tests) cannot be narrowed by dtype=: normed in their own dtype.
    wide = any(t.dtype == torch.float64 for t in tensors)
    norms = torch._foreach_norm(tensors, 2.0, dtype=None if wide else torch.float32)
    return torch.stack(norms).pow(2).sum().float()


def global_grad_norm(pieces: Iterable[tuple[torch.Tensor, torch.Tensor, bool]], *,
                     groups: GradGroups, sharded_over_dp: bool = False) -> torch.Tensor:
    """Global L2 norm (0-dim fp32; NaN/Inf if any gradient is) of the reduced gradient.

    pieces: ``(gradient, its parameter, is_expert)``; the gradient is the whole ``p.grad``
    (replicated optimizer) or the part of it this rank owns (ZeRO-1), any shape.
    sharded_over_dp: the pieces are disjoint across ``groups.dp`` (ZeRO-1 ownership), so all
    squares are summed over DP, which also covers the expert shards (``groups.ep`` unused).
    Otherwise every DP rank holds the same reduced gradients and only expert squares are summed
    over ``groups.ep``. TP-shard squares are summed over ``groups.tp``, the total over
    ``groups.pp``. Every rank of these groups must call it (collectives in a fixed order).
    """
    parts: list[list[torch.Tensor]] = [[], [], []]  # tp-sharded, expert, replicated
    device = torch.device("cpu")
    for g, p, expert in pieces:
        parts[1 if expert else 0 if is_tp_sharded(p) else 2].append(g.detach())
        device = g.device
    sq = [sum_of_squares(ts, device) for ts in parts]
    if sharded_over_dp and group_size(groups.dp) > 1:
        both = torch.stack(sq)  # one 3-element collective for the three kinds
        dist.all_reduce(both, group=groups.dp)
        sq = [t.clone() for t in both.unbind()]
    if group_size(groups.tp) > 1:
        dist.all_reduce(sq[0], group=groups.tp)
    if not sharded_over_dp and group_size(groups.ep) > 1:
        dist.all_reduce(sq[1], group=groups.ep)
    total = sq[0] + sq[1] + sq[2]
    if group_size(groups.pp) > 1:
        dist.all_reduce(total, group=groups.pp)
    return total.sqrt()


def clip_grads_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float | None) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + 1e-6))`` without a host sync;
    nothing for ``max_norm`` None or <= 0 (clipping off)."""
    if max_norm is None or max_norm <= 0 or not grads:
        return
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


class DataParallelGrads:
    """The replicated optimizer's gradient path: every rank reduces and keeps whole gradients.

    params: the parameters the optimizer steps (their ``.grad``, any dtypes); expert_params:
    the routed-expert ones among them (reduced over ``groups.expert_dp``). Same surface as
    ``ShardedOptimizer``'s gradient methods.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, groups: GradGroups,
                 expert_params: Iterable[torch.Tensor] = ()) -> None:
        self.params, self.groups = list(params), groups
        self._expert_ids = {id(p) for p in expert_params}

    def _grads(self) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        return [(p.grad, p, id(p) in self._expert_ids) for p in self.params if p.grad is not None]

    def reduce_grads(self) -> None:
        """All-reduce to the convention of the module docstring: dense gradients averaged over
        DP; expert gradients summed over expert-DP, divided by the DP size."""
        grads, dp = self._grads(), self.groups.loss_ranks
        allreduce_mean([g for g, _, expert in grads if not expert], self.groups.dp, dp)
        allreduce_sum_then_scale([g for g, _, expert in grads if expert], self.groups.expert_dp, 1.0 / dp)

    def global_grad_norm(self) -> torch.Tensor:
        """Norm of the (already reduced) gradients, 0-dim fp32 on their device."""
        return global_grad_norm(self._grads(), groups=self.groups)

    def clip_grads_(self, norm: torch.Tensor, max_norm: float | None) -> None:
        clip_grads_([g for g, _, _ in self._grads()], norm, max_norm)
