"""Causal depthwise short convolution + SiLU (the KDA q/k/v pre-mix), with backend dispatch.

On CUDA the kernel registry's ``short_conv`` family picks the kernel (``kernels.short_conv``):
``k3train`` (the default: our Triton kernels, ``short_conv_triton``, whose backward recomputes
the pre-activation in registers), ``fla`` (fla's ``causal_conv1d``) or ``torch``; elsewhere, torch.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3train.ops import backends as ops_backends
from k3train.ops import fla_kernel
from k3train.ops.documents import conv_chunk_indices, positions_in_document

__all__ = ["short_conv_silu", "short_conv_silu_torch", "short_conv_silu_varlen_torch"]


def short_conv_silu_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, C]``, weight ``[C, W]`` -> ``silu(y)`` ``[B, T, C]`` with
    ``y[t] = sum_j weight[:, j] * x[t - W + 1 + j]`` (zeros before the first token)."""
    width = weight.shape[1]
    xt = F.pad(x.transpose(1, 2), (width - 1, 0))
    y = F.conv1d(xt, weight.unsqueeze(1).to(x.dtype), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(y)


def short_conv_silu_varlen_torch(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``short_conv_silu_torch`` with no carry-over across documents: a tap that would read a
    token of an earlier document reads zero, as at the start of a sequence. x ``[B, T, C]``,
    weight ``[C, W]``, cu_seqlens ``[N+1]`` (``k3train.ops.documents``) -> ``[B, T, C]``."""
    B, T, _ = x.shape
    width = weight.shape[1]
    pos = positions_in_document(cu_seqlens, B, T).unsqueeze(-1)  # [B, T, 1]
    xp = F.pad(x, (0, 0, width - 1, 0))
    w = weight.to(x.dtype)
    y = None
    for j in range(width):
        lag = width - 1 - j  # tap j reads x[t - lag]
        tap = xp[:, j:j + T] * w[:, j]
        if lag:
            tap = tap * (pos >= lag).to(x.dtype)
        y = tap if y is None else y + tap
    return F.silu(y)


@functools.cache
def _triton_conv():
    try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
        from k3train.ops.short_conv_triton import short_conv_silu_triton
    except ImportError:
        return None
    return short_conv_silu_triton


class TritonShortConv:
    """Our Triton short conv as a backend: whether it is importable, and whether it takes these
    shapes (x ``[B, T, C]``, weight ``[C, W]``; the device is the run's choice)."""

    @staticmethod
    def is_available() -> bool:
        return _triton_conv() is not None

    @staticmethod
    def verify(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.ndim == 3 and weight.ndim == 2 and weight.shape[0] == x.shape[-1]


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``short_conv_silu_torch`` on the backend the registry picks for ``x``'s device (same
    result). x ``[B, T, C]``, weight ``[C, W]``. cu_seqlens: document boundaries ``[N+1]`` over
    the flattened ``B*T`` tokens (``k3train.ops.documents``), or None for one sequence per row;
    with them, fla's varlen ``causal_conv1d`` where the registry picks fla, else the masked
    torch form (our Triton kernel has no varlen mode)."""
    if cu_seqlens is not None:
        return _short_conv_varlen(x, weight, cu_seqlens)
    choice = ops_backends.current().backend("short_conv", x.device.type)
    if choice == "k3train" and TritonShortConv.is_available() and TritonShortConv.verify(x, weight):
        return _triton_conv()(x, weight)
    fused = fla_kernel("short_conv", x.device, "fla.modules.causal_conv1d", "causal_conv1d")
    if fused is not None:
        y, _ = fused(x, weight.to(x.dtype), activation="silu")
        return y
    return short_conv_silu_torch(x, weight)


def _short_conv_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Document-masked short conv: fla's ``causal_conv1d`` with ``cu_seqlens`` (batch flattened
    to one row, fla's varlen convention) when the registry picks fla, else the torch form."""
    fused = fla_kernel("short_conv", x.device, "fla.modules.causal_conv1d", "causal_conv1d")
    if fused is None:
        return short_conv_silu_varlen_torch(x, weight, cu_seqlens)
    B, T, C = x.shape
    # The chunk list built on the device (fla would read the boundaries on the host): a
    # CUDA-graphed step records it, and an eager one skips a host sync per call.
    cu_ext, chunk_indices = conv_chunk_indices(cu_seqlens, B * T)
    y, _ = fused(x.reshape(1, B * T, C), weight.to(x.dtype), activation="silu", cu_seqlens=cu_ext,
                 chunk_indices=chunk_indices)
    return y.reshape(B, T, C)
