"""Causal depthwise short convolution + SiLU (the KDA q/k/v pre-mix), with backend dispatch.

On CUDA (``K3TRAIN_KERNELS=auto``) it runs our Triton kernels (``short_conv_triton``: a
backward that recomputes the pre-activation in registers); ``BACKEND = "fla"`` picks fla's
``causal_conv1d`` instead (the benchmark's side-by-side ablation); elsewhere, torch.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3train.ops import fla_kernel, use_fla

BACKEND = "k3train"
"""Which GPU kernel ``short_conv_silu`` uses on CUDA: ``"k3train"`` (ours) or ``"fla"``."""

__all__ = ["short_conv_silu", "short_conv_silu_torch"]


def short_conv_silu_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, C]``, weight ``[C, W]`` -> ``silu(y)`` ``[B, T, C]`` with
    ``y[t] = sum_j weight[:, j] * x[t - W + 1 + j]`` (zeros before the first token)."""
    width = weight.shape[1]
    xt = F.pad(x.transpose(1, 2), (width - 1, 0))
    y = F.conv1d(xt, weight.unsqueeze(1).to(x.dtype), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(y)


@functools.cache
def _triton_conv():
    try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
        from k3train.ops.short_conv_triton import short_conv_silu_triton
    except ImportError:
        return None
    return short_conv_silu_triton


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``short_conv_silu_torch`` on the fastest backend: our Triton kernels on CUDA (fla's
    with ``BACKEND = "fla"``), torch elsewhere. x ``[B, T, C]``, weight ``[C, W]``."""
    if BACKEND not in ("k3train", "fla"):
        raise ValueError(f"short_conv.BACKEND={BACKEND!r}: allowed values are 'k3train' and 'fla'")
    if BACKEND == "k3train" and use_fla(x.device) and _triton_conv() is not None:
        return _triton_conv()(x, weight)
    fused = fla_kernel(x.device, "fla.modules.causal_conv1d", "causal_conv1d")
    if fused is not None:
        y, _ = fused(x, weight.to(x.dtype), activation="silu")
        return y
    return short_conv_silu_torch(x, weight)
