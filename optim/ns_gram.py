"""Gram Newton-Schulz: Muon's quintic iteration run on the small Gram matrix of a wide block.

For a wide block ``X: [a, b]`` (``a <= b``) each standard step is

    A = X X^T                 (2 a^2 b FLOPs)
    B = b_ A + c_ A A         (2 a^3)
    X = a_ X + B X            (2 a^2 b)      i.e.  X_{k+1} = P_k X_k,  P_k = a_ I + B_k

Every ``P_k`` is an ``[a, a]`` polynomial in the Gram matrix, so ``X_n = Q_n X_0`` with
``Q_n = P_{n-1} ... P_0``, and ``A_{k+1} = P_k A_k P_k``. The Gram form forms ``R = X_0 X_0^T``
once, iterates ``R`` and ``Q`` (only ``[a, a]`` products) and touches the wide ``X`` once more
at the end (``Q X_0``). Same polynomial map, so in exact arithmetic the same result; the wide
products drop from ``2 * steps`` to 2.

Stability: ``Q`` grows like ``1 / sigma`` for a small singular value ``sigma`` (up to
``a_^n ~ 3.44^n`` after ``n`` steps), so rounding ``Q`` (and the drift between the iterated
``R`` and the true ``Q X_0 (Q X_0)^T``) costs accuracy in half precision. The iteration therefore
*restarts*: after the steps of one segment it forms ``X = Q X_0`` and a fresh Gram matrix from it
(``GRAM_SEGMENTS``: segments of 2, then 3 steps). Restarting keeps the map the same.

FLOPs per segment of ``n`` steps: ``4 a^2 b`` (the Gram product and ``Q X``) plus
``(8 n - 6) a^3`` (per step ``R R``; ``Q`` updates on all but the first; the ``R`` update
``P R P``, two products, on all but the last). See ``ns_flops_gram``.
"""
from __future__ import annotations

from typing import Callable, Literal

import torch

__all__ = ["GRAM_AUTO_FACTOR", "NS_MODES", "gram_iterate", "gram_segments", "ns_flops_gram",
           "ns_flops_standard", "use_gram"]

NS_MODES = ("standard", "gram", "auto")
NSMode = Literal["standard", "gram", "auto"]

# auto picks the Gram form where the standard iteration costs at least this many times its
# FLOPs. 2, not 1: the Gram form's [a, a] GEMMs are small (a = 128 for a per-head block), so they
# run further below the GPU's matmul rate than the wide ones; unmeasured on a GPU, so a margin.
# With 5 steps and segments (2, 3) the ratio is (20 r + 10) / (8 r + 28) for aspect r = b / a:
# 2 at r = 11.5, 2.37 at r = 56 (a [128, 7168] per-head block), 2.5 as r grows.
GRAM_AUTO_FACTOR = 2.0

# Steps per segment: 2, then 3 at a time (a restart re-forms X and its Gram matrix). Two steps
# lift a small singular value at most a_^2 ~ 12-fold, three at most ~41-fold, which bounds how
# large Q (and its rounding) gets in bf16.
_FIRST_SEGMENT, _SEGMENT = 2, 3


def gram_segments(steps: int) -> list[int]:
    """Steps per segment of a ``steps``-step Gram iteration, e.g. 5 -> [2, 3], 7 -> [2, 3, 2]."""
    if steps < 1:
        raise ValueError(f"Newton-Schulz needs steps >= 1, got {steps}")
    segs = [min(steps, _FIRST_SEGMENT)]
    while sum(segs) < steps:
        segs.append(min(_SEGMENT, steps - sum(segs)))
    return segs


def ns_flops_standard(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of ``steps`` standard quintic steps on one ``[rows, cols]`` block: per step on the
    wide orientation ``[a, b]`` the Gram product (2a^2b), ``b_ A + c_ A A`` (2a^3) and ``B X``
    (2a^2b); elementwise work ignored. Equals ``optim.muon.ns_flops``."""
    a, b = sorted((rows, cols))
    return steps * (4 * a * a * b + 2 * a ** 3)


def ns_flops_gram(rows: int, cols: int, steps: int = 5, segments: list[int] | None = None) -> int:
    """FLOPs of the Gram form of ``steps`` quintic steps on one ``[rows, cols]`` block with
    ``segments`` (default ``gram_segments(steps)``): per segment of ``n`` steps
    ``4 a^2 b + (8 n - 6) a^3`` on the wide orientation ``[a, b]``; elementwise work ignored."""
    a, b = sorted((rows, cols))
    segs = gram_segments(steps) if segments is None else segments
    return sum(4 * a * a * b + (8 * n - 6) * a ** 3 for n in segs)


def use_gram(mode: NSMode, rows: int, cols: int, steps: int = 5) -> bool:
    """Whether a ``[rows, cols]`` block runs the Gram form under ``mode``: always for "gram",
    never for "standard", for "auto" where the standard form costs at least
    ``GRAM_AUTO_FACTOR`` times the Gram form's FLOPs (aspect ``max / min >= 11.5`` at 5 steps)."""
    if mode == "standard":
        return False
    if mode == "gram":
        return True
    if mode == "auto":
        return ns_flops_standard(rows, cols, steps) >= GRAM_AUTO_FACTOR * ns_flops_gram(rows, cols, steps)
    raise ValueError(f"Newton-Schulz mode must be one of {', '.join(NS_MODES)}; got {mode!r}")


def gram_iterate(X: torch.Tensor, steps: int, *, coefficients: tuple[float, float, float],
                 baddbmm: Callable[..., torch.Tensor], out_scale: float = 1.0,
                 segments: list[int] | None = None) -> torch.Tensor:
    """``steps`` quintic Newton-Schulz steps in Gram form on a stack of wide, normalised blocks.

    ``X: [S, a, b]`` with ``a <= b``, already scaled so every singular value is in [0, 1] (as
    ``optim.muon.newton_schulz`` prepares it). Returns ``out_scale * X_steps: [S, a, b]`` in
    ``X``'s dtype, the standard iteration's result up to rounding. ``baddbmm`` is the
    ``beta * C + alpha * A @ B`` that the standard path uses for these tensors (ours on CUDA).
    """
    ca, cb, cc = coefficients
    segs = gram_segments(steps) if segments is None else segments
    if sum(segs) != steps or min(segs) < 1:
        raise ValueError(f"Gram Newton-Schulz segments {segs} do not split {steps} steps")
    for si, n in enumerate(segs):
        R = X @ X.mT                                    # [S, a, a], the one Gram product per segment
        Q = None
        for i in range(n):
            B = baddbmm(R, R, R, beta=cb, alpha=cc)     # B = b R + c R R;  P = a I + B
            if Q is None:
                Q = B.clone()
                Q.diagonal(dim1=-2, dim2=-1).add_(ca)   # Q = P_0
            else:
                Q = baddbmm(Q, B, Q, beta=ca, alpha=1.0)  # Q = P Q = a Q + B Q
            if i < n - 1:
                # R' = P R P, both factors with a_ kept out of the rounded matrix (a R + B R).
                PR = baddbmm(R, B, R, beta=ca, alpha=1.0)
                R = baddbmm(PR, PR, B, beta=ca, alpha=1.0)
        if si == len(segs) - 1 and out_scale != 1.0:
            Q = Q * out_scale                           # [a, a]: cheaper than scaling [a, b]
        X = Q @ X                                       # the segment's one wide product
    return X
