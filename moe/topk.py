"""Row-wise top-k of routing scores, with an optional per-column bias added first.

On CUDA, for up to 1024 experts and k <= 32 (K3's 896 experts top-16 and Quantile Balancing's
top-17 included), it runs one Triton kernel (``topk_triton``: several times faster than
``torch.topk`` on k3_mini's ``[16384, 64]``; measured: see
benchmarks/README.md; at the real router sizes:
benchmarks/README.md); elsewhere, for other shapes or dtypes, or where the run's kernel registry
chose torch (``kernels.router_topk``, handed over by ``k3train.ops.kernels.apply`` through
``set_kernel``), it is ``torch.topk(scores + bias, k, dim=-1)``. Triton comes with CUDA builds of
torch; it is imported only when a CUDA tensor arrives.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["row_topk"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL = {"router_topk": "k3train"}
KERNELS = ("k3train", "torch")


def set_kernel(name: str) -> None:
    """The backend for CUDA tensors, ``"k3train"`` (ours) or ``"torch"``. Called by
    ``k3train.ops.kernels.apply`` from the run's config; nothing else sets it."""
    if name not in KERNELS:
        raise ValueError(f"moe.topk kernel {name!r}: allowed values are {', '.join(KERNELS)}")
    _KERNEL["router_topk"] = name


@functools.cache
def _triton_topk():
    try:
        from . import topk_triton
    except ImportError:
        return None
    return topk_triton


def _use_kernel(scores: torch.Tensor, k: int, bias: torch.Tensor | None) -> bool:
    if not scores.is_cuda or _KERNEL["router_topk"] != "k3train":
        return False
    if scores.ndim != 2 or scores.dtype not in _KERNEL_DTYPES:
        return False
    if bias is not None and (bias.dtype not in _KERNEL_DTYPES or bias.shape != scores.shape[-1:]
                             or not bias.is_contiguous()):
        return False
    mod = _triton_topk()
    return mod is not None and 0 < k <= mod.MAX_K and scores.shape[1] <= mod.MAX_COLUMNS


def row_topk(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores ``[N, E]``, bias ``[E]`` or None -> (values ``[N, k]``, indices ``[N, k]`` int64)
    of ``scores + bias``, largest first (values in ``promote(scores, bias)``)."""
    if not 0 < k <= scores.shape[-1]:
        raise ValueError(f"row_topk: k={k} must be in [1, {scores.shape[-1]}] (the number of "
                         f"columns of scores {tuple(scores.shape)})")
    if _use_kernel(scores, k, bias):
        return _triton_topk().row_topk_triton(scores.contiguous(), k, bias)
    keyed = scores if bias is None else scores + bias
    values, indices = torch.topk(keyed, k, dim=-1)
    return values, indices
