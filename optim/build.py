"""Build the optimizer(s) for a parameter table and wrap them as one ``CombinedOptimizer``."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .adamw_state import NarrowStateAdamW
from .muon import Muon
from .muon_distributed import DistributedMuon
from .param_groups import OPTIMIZER_NAMES, ParamGroupPlan, plan_param_groups
from .param_table import ParamEntry

__all__ = ["OPTIMIZER_NAMES", "CombinedOptimizer", "build_optimizer"]


class CombinedOptimizer:
    """Several torch optimizers driven as one (Muon for matrices, AdamW for the rest).

    ``param_groups`` is the concatenation of the inner optimizers' group dicts (the same dict
    objects), so a scheduler that writes ``group["lr"] = group["base_lr"] * factor`` reaches
    every inner optimizer. Each group also carries ``kind`` ("muon"/"adamw"), ``lr_mult`` and
    ``wd_mult`` for logging.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        # Evaluate the closure once here: letting each inner optimizer call it would run
        # forward/backward once per optimizer.
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def warm_kernels(self) -> None:
        """Each inner optimizer's ``warm_kernels`` where it has one (Muon): the next step's
        Triton kernels launched on scratch tensors, for compile-ahead. Changes nothing."""
        for opt in self.optimizers:
            warm = getattr(opt, "warm_kernels", None)
            if warm is not None:
                warm()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def _kinds(self) -> list[str]:
        # state_kind: DistributedMuon's state is Muon's, so checkpoints interchange.
        return [getattr(opt, "state_kind", type(opt).__name__) for opt in self.optimizers]

    def state_dict(self) -> dict[str, Any]:
        return {
            "kinds": self._kinds(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        kinds = self._kinds()
        if state_dict.get("kinds") != kinds:
            raise ValueError(
                f"optimizer state is for {state_dict.get('kinds')}, this optimizer is {kinds}"
            )
        for opt, sd in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(sd)

    def __repr__(self) -> str:
        inner = ", ".join(f"{type(o).__name__}({len(o.param_groups)} groups)" for o in self.optimizers)
        return f"CombinedOptimizer({inner})"


def _torch_groups(plans: list[ParamGroupPlan], muon: bool) -> list[dict[str, Any]]:
    """``plan_param_groups``' groups as torch group dicts: ``params`` as (name, tensor) pairs
    (torch records the names in ``group["param_names"]``), Muon groups with per-entry ``heads``."""
    groups = []
    for plan in plans:
        group = {"params": [(e.name, e.param) for e in plan.entries], **plan.hyper()}
        if muon:
            group["heads"] = [e.heads for e in plan.entries]
        groups.append(group)
    return groups


def build_optimizer(
    table: list[ParamEntry],
    name: str = "adamw",
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    muon_lr: float | None = None,
    muon_momentum: float = 0.95,
    muon_group_of: Callable[[torch.Tensor], Any] | None = None,
    muon_tp_group: Any = None,
    state_dtype: torch.dtype | None = None,
    ns_mode: str = "standard",
) -> CombinedOptimizer:
    """Build the optimizer named ``name`` ("adamw" or "muon") over a parameter table.

    "adamw": every entry goes to AdamW. "muon": entries marked muon go to Muon (Nesterov,
    per-entry heads) at ``muon_lr`` (default ``lr``: the Moonlight scale makes AdamW's lr
    fit), the rest to AdamW. Groups from ``plan_param_groups`` (shared with ``ShardedOptimizer``):
    lr = base lr * ``lr_mult``; weight decay = ``weight_decay * wd_mult``. Both optimizers use
    decoupled weight decay ``p *= 1 - lr * wd``. Gradients must already be reduced
    (``optim.grads.DataParallelGrads``).

    muon_group_of: None (every rank orthogonalises every Muon matrix it holds), or a function
    giving the process group each Muon parameter is replicated over (dense: DP; routed experts:
    expert DP): Muon is then ``DistributedMuon``, which runs Newton-Schulz once per matrix block
    per group and all-gathers the updates (same update, same checkpoint state).

    muon_tp_group: the tensor-parallel group (None: no TP); Muon then orthogonalises each
    TP-sharded matrix whole (``optim.muon.tp_shard``), all-gathering its inputs over the group.

    state_dtype: the dtype of AdamW's moments and Muon's momentum; None: each parameter's own
    (today's optimizers, unchanged). A narrower one (bf16) gives AdamW as ``NarrowStateAdamW``.

    ns_mode: Muon's Newton-Schulz form, "standard", "gram" or "auto" (``optim.ns_gram``).
    """
    plans = plan_param_groups(table, name, lr=lr, weight_decay=weight_decay, muon_lr=muon_lr)
    muon_plans = [g for g in plans if g.kind == "muon"]
    adamw_plans = [g for g in plans if g.kind == "adamw"]

    optimizers: list[torch.optim.Optimizer] = []
    if muon_plans:
        mlr = lr if muon_lr is None else muon_lr
        kw = dict(lr=mlr, weight_decay=weight_decay, momentum=muon_momentum, nesterov=True,
                  state_dtype=state_dtype, ns_mode=ns_mode, tp_group=muon_tp_group)
        groups = _torch_groups(muon_plans, muon=True)
        optimizers.append(Muon(groups, **kw) if muon_group_of is None else
                          DistributedMuon(groups, group_of=muon_group_of, **kw))
    if adamw_plans:
        # torch's fused CUDA kernel: one launch per few tensors instead of a foreach chain of
        # ~10 passes over the optimizer state, with the same update rule.
        fused = all(e.param.is_cuda for g in adamw_plans for e in g.entries) or None
        groups, hyper = _torch_groups(adamw_plans, muon=False), dict(lr=lr, betas=betas, eps=eps,
                                                                      weight_decay=weight_decay)
        if state_dtype is None or all(e.param.dtype == state_dtype for g in adamw_plans for e in g.entries):
            optimizers.append(torch.optim.AdamW(groups, fused=fused, **hyper))
        else:
            optimizers.append(NarrowStateAdamW(groups, state_dtype=state_dtype, **hyper))
    return CombinedOptimizer(optimizers)
