"""Build the optimizer(s) for a parameter table and wrap them as one ``CombinedOptimizer``."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .muon import Muon
from .param_table import ParamEntry

__all__ = ["OPTIMIZER_NAMES", "CombinedOptimizer", "build_optimizer"]

OPTIMIZER_NAMES = ("adamw", "muon")


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

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kinds": [type(opt).__name__ for opt in self.optimizers],
            "optimizers": [opt.state_dict() for opt in self.optimizers],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        kinds = [type(opt).__name__ for opt in self.optimizers]
        if state_dict.get("kinds") != kinds:
            raise ValueError(
                f"optimizer state is for {state_dict.get('kinds')}, this optimizer is {kinds}"
            )
        for opt, sd in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(sd)

    def __repr__(self) -> str:
        inner = ", ".join(f"{type(o).__name__}({len(o.param_groups)} groups)" for o in self.optimizers)
        return f"CombinedOptimizer({inner})"


def _groups(entries: list[ParamEntry], kind: str, lr: float, weight_decay: float,
            muon: bool) -> list[dict[str, Any]]:
    """One group per (lr_mult, wd_mult), in order of first appearance (stable for resume)."""
    groups: dict[tuple[float, float], dict[str, Any]] = {}
    for e in entries:
        key = (e.lr_mult, e.wd_mult)
        if key not in groups:
            groups[key] = {"params": [], "lr": lr * e.lr_mult, "base_lr": lr * e.lr_mult,
                           "weight_decay": weight_decay * e.wd_mult, "kind": kind,
                           "lr_mult": e.lr_mult, "wd_mult": e.wd_mult}
            if muon:
                groups[key]["heads"] = []
        # (name, tensor) pairs: torch records the names in group["param_names"].
        groups[key]["params"].append((e.name, e.param))
        if muon:
            groups[key]["heads"].append(e.heads)
    return list(groups.values())


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
) -> CombinedOptimizer:
    """Build the optimizer named ``name`` ("adamw" or "muon") over a parameter table.

    "adamw": every entry goes to AdamW. "muon": entries marked muon go to Muon (Nesterov,
    per-entry heads) at ``muon_lr`` (default ``lr``: the Moonlight scale makes AdamW's lr
    fit), the rest to AdamW. Group lr = base lr * ``lr_mult``; weight decay = ``weight_decay *
    wd_mult``. Both optimizers use decoupled weight decay ``p *= 1 - lr * wd``.
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZER_NAMES)}")
    if not table:
        raise ValueError("build_optimizer: the parameter table is empty")
    use_muon = name == "muon"
    muon_entries = [e for e in table if use_muon and e.optimizer == "muon"]
    adamw_entries = [e for e in table if not (use_muon and e.optimizer == "muon")]

    optimizers: list[torch.optim.Optimizer] = []
    if muon_entries:
        mlr = lr if muon_lr is None else muon_lr
        optimizers.append(Muon(_groups(muon_entries, "muon", mlr, weight_decay, muon=True),
                               lr=mlr, weight_decay=weight_decay, momentum=muon_momentum,
                               nesterov=True))
    if adamw_entries:
        # torch's fused CUDA kernel: one launch per few tensors instead of a foreach chain of
        # ~10 passes over the optimizer state, with the same update rule.
        fused = all(e.param.is_cuda for e in adamw_entries) or None
        optimizers.append(torch.optim.AdamW(
            _groups(adamw_entries, "adamw", lr, weight_decay, muon=False),
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused))
    return CombinedOptimizer(optimizers)
