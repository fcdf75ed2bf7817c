"""Causal depthwise short convolution + SiLU (the KDA q/k/v pre-mix).

``short_conv_silu_split`` is what the layer runs: one convolution over the q/k/v channels of a
fused projection, returning q, k and v as separate contiguous tensors (what ``chunk_kda`` reads
without a copy). The taps are written as W shifted multiply-adds, which ``torch.compile`` turns
into one kernel forward (conv, SiLU, the three outputs) and one per gradient backward. On an
H200 (B=4, T=4096, 3 x 2048 channels) fla's ``causal_conv1d`` backward took 0.62 ms where the
bytes it moves need ~0.1 ms; this form also drops the three copies that made its strided q/k/v
views contiguous and the separate SiLU recompute.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

__all__ = ["short_conv_silu", "short_conv_silu_split", "short_conv_silu_torch"]


def short_conv_silu_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Reference. x ``[B, T, C]``, weight ``[C, W]`` -> ``silu(y)`` ``[B, T, C]`` with
    ``y[t] = sum_j weight[:, j] * x[t - W + 1 + j]`` (zeros before the first token)."""
    width = weight.shape[1]
    xt = F.pad(x.transpose(1, 2), (width - 1, 0))
    y = F.conv1d(xt, weight.unsqueeze(1).to(x.dtype), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(y)


def _split_eager(x: torch.Tensor, weight: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    width, T = weight.shape[1], x.shape[1]
    ct = torch.promote_types(x.dtype, torch.float32)  # taps and SiLU in fp32 (fp64 stays fp64)
    xp = F.pad(x.to(ct), (0, 0, width - 1, 0))          # [B, T + W - 1, C]
    w = weight.to(ct)
    y = xp[:, :T] * w[:, 0]
    for j in range(1, width):
        y = y + xp[:, j:j + T] * w[:, j]
    y = F.silu(y).to(x.dtype)
    return tuple(t.contiguous() for t in y.chunk(parts, dim=-1))


@functools.cache
def _compiled():
    # Not fullgraph: past Dynamo's recompile limit (many shapes in one process) it runs eagerly.
    return torch.compile(_split_eager, dynamic=False)


def short_conv_silu_split(x: torch.Tensor, weight: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """x ``[B, T, C]`` (any strides), weight ``[C, W]`` -> ``parts`` contiguous tensors
    ``[B, T, C / parts]``: ``short_conv_silu_torch(x, weight)`` split along channels, in x's
    dtype. Compiled on CUDA (``K3TRAIN_COMPILE=0`` keeps it eager)."""
    if x.shape[-1] % parts:
        raise ValueError(f"short_conv_silu_split: {x.shape[-1]} channels do not split into {parts} parts")
    if x.is_cuda and os.environ.get("K3TRAIN_COMPILE", "1") != "0":
        return _compiled()(x, weight, parts)
    return _split_eager(x, weight, parts)


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``short_conv_silu_torch`` as one output ``[B, T, C]`` (``short_conv_silu_split``, 1 part)."""
    return short_conv_silu_split(x, weight, 1)[0]
