"""Row-wise top-k of routing scores, with an optional per-column bias added first.

On CUDA, for up to 1024 experts and k <= 32 (K3's 896 experts top-16 and Quantile Balancing's
top-17 included), it runs one Triton kernel (``topk_triton``: several times faster than
``torch.topk`` on k3_mini's ``[16384, 64]``; measured: see
benchmarks/README.md; at the real router sizes:
benchmarks/README.md); elsewhere, for other shapes or dtypes, or where the run's kernel registry
chose torch (``kernels.router_topk``, handed over by ``k3train.ops.kernels.apply`` in
``moe.backends``), it is ``torch.topk(scores + bias, k, dim=-1)``. Triton comes with CUDA builds of
torch; it is imported only when a CUDA tensor arrives.
"""
from __future__ import annotations

import functools

import torch

from .backends import current as current_backends

__all__ = ["row_topk"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _triton_topk():
    try:
        from . import topk_triton
    except ImportError:
        return None
    return topk_triton


class TritonTopk:
    """Our Triton top-k kernel as a backend: whether it is importable, and whether it takes
    these shapes and dtypes (scores ``[N, E]`` in fp32/bf16/fp16 with ``E <= MAX_COLUMNS``,
    ``0 < k <= MAX_K``, a contiguous bias ``[E]`` of those dtypes or None). The device is the
    run's choice, checked by the op."""

    @staticmethod
    def is_available() -> bool:
        return _triton_topk() is not None

    @staticmethod
    def verify(scores: torch.Tensor, k: int, bias: torch.Tensor | None) -> bool:
        if scores.ndim != 2 or scores.dtype not in _KERNEL_DTYPES:
            return False
        if bias is not None and (bias.dtype not in _KERNEL_DTYPES or bias.shape != scores.shape[-1:]
                                 or not bias.is_contiguous()):
            return False
        mod = _triton_topk()
        return 0 < k <= mod.MAX_K and scores.shape[1] <= mod.MAX_COLUMNS


def _use_kernel(scores: torch.Tensor, k: int, bias: torch.Tensor | None) -> bool:
    """Whether the run chose our kernel and it can take these inputs."""
    return (current_backends().router_topk == "k3train" and scores.is_cuda
            and TritonTopk.is_available() and TritonTopk.verify(scores, k, bias))


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
