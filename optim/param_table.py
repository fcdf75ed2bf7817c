"""Per-parameter optimizer table: which optimizer, lr/wd multipliers and Muon heads per weight.

The table is plain data built from the model's named parameters and an ordered rule list, so
nothing is patched onto ``nn.Parameter`` objects and the resolved table can be logged at
start-up (``format_table``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

__all__ = ["OPTIMIZERS", "ParamRule", "ParamEntry", "build_param_table", "format_table"]

OPTIMIZERS = ("muon", "adamw")


def _check_optimizer(kind: str, where: str) -> None:
    if kind not in OPTIMIZERS:
        raise ValueError(f"{where}: unknown optimizer {kind!r}; allowed: {', '.join(OPTIMIZERS)}")


@dataclass(frozen=True)
class ParamRule:
    """One rule: parameters whose qualified name matches ``pattern`` (``re.search``, so anchor
    with ``^``/``$`` when needed) use ``optimizer`` with the given multipliers. ``heads`` splits
    a Muon matrix's rows per head (q/k/v projections); it is ignored for AdamW."""

    pattern: str
    optimizer: str
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    heads: int | None = None
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_optimizer(self.optimizer, f"ParamRule({self.pattern!r})")
        if self.heads is not None and (not isinstance(self.heads, int) or self.heads < 1):
            raise ValueError(f"ParamRule({self.pattern!r}): heads must be a positive int or None")
        try:
            regex = re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"ParamRule: bad regex {self.pattern!r}: {exc}") from exc
        object.__setattr__(self, "_regex", regex)

    def matches(self, name: str) -> bool:
        return self._regex.search(name) is not None


@dataclass(frozen=True, eq=False)
class ParamEntry:
    """The resolved choice for one parameter (``heads`` is None unless optimizer is muon)."""

    name: str
    param: torch.nn.Parameter
    optimizer: str
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    heads: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)


def build_param_table(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    rules: Iterable[ParamRule] = (),
    default_2d: str = "muon",
    default_other: str = "adamw",
) -> list[ParamEntry]:
    """Resolve every trainable parameter against ``rules`` (first match wins).

    Unmatched parameters get ``default_2d`` if 2-D, else ``default_other``. Muon takes 2-D
    parameters and, by an explicit rule, 3-D stacks of matrices (routed experts); a rule that
    sends another shape to Muon raises naming the parameter. Frozen parameters
    (``requires_grad=False``) and repeats of an already-listed tensor (tied weights) are left
    out: an optimizer must see each tensor once.
    """
    rules = list(rules)
    _check_optimizer(default_2d, "default_2d")
    _check_optimizer(default_other, "default_other")
    if default_other == "muon":
        raise ValueError("default_other cannot be 'muon': Muon only handles 2-D matrices")
    table: list[ParamEntry] = []
    seen: set[int] = set()
    for name, param in named_parameters:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        rule = next((r for r in rules if r.matches(name)), None)
        if rule is None:
            kind = default_2d if param.ndim == 2 else default_other
            table.append(ParamEntry(name, param, kind))
            continue
        if rule.optimizer == "muon":
            if param.ndim not in (2, 3) or (param.ndim == 3 and rule.heads is not None):
                raise ValueError(
                    f"rule {rule.pattern!r} sends parameter {name!r} of shape "
                    f"{tuple(param.shape)} to Muon, which handles 2-D matrices (heads optional) "
                    f"and 3-D stacks of matrices [S, A, B] (no heads)"
                )
            if rule.heads is not None and param.shape[0] % rule.heads != 0:
                raise ValueError(
                    f"rule {rule.pattern!r}: parameter {name!r} has {param.shape[0]} rows, "
                    f"not divisible by heads={rule.heads}"
                )
        heads = rule.heads if rule.optimizer == "muon" else None
        table.append(ParamEntry(name, param, rule.optimizer, rule.lr_mult, rule.wd_mult, heads))
    return table


def format_table(table: list[ParamEntry]) -> str:
    """A fixed-width text table (name, shape, optimizer, lr x, wd x, heads) plus totals."""
    header = ("name", "shape", "optimizer", "lr x", "wd x", "heads")
    rows = [
        (e.name, "x".join(map(str, e.shape)) or "scalar", e.optimizer, f"{e.lr_mult:g}",
         f"{e.wd_mult:g}", "-" if e.heads is None else str(e.heads))
        for e in table
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for kind in OPTIMIZERS:
        picked = [e for e in table if e.optimizer == kind]
        if picked:
            numel = sum(e.param.numel() for e in picked)
            lines.append(f"{kind}: {len(picked)} tensors, {numel:,} elements")
    return "\n".join(lines)
