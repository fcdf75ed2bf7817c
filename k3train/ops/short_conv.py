"""Causal depthwise short convolution + SiLU (the KDA q/k/v pre-mix), with backend dispatch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.ops import fla_kernel

__all__ = ["short_conv_silu", "short_conv_silu_torch"]


def short_conv_silu_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, C]``, weight ``[C, W]`` -> ``silu(y)`` ``[B, T, C]`` with
    ``y[t] = sum_j weight[:, j] * x[t - W + 1 + j]`` (zeros before the first token)."""
    width = weight.shape[1]
    xt = F.pad(x.transpose(1, 2), (width - 1, 0))
    y = F.conv1d(xt, weight.unsqueeze(1).to(x.dtype), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(y)


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``short_conv_silu_torch`` on the fastest backend: fla's fused Triton kernel on CUDA."""
    fused = fla_kernel(x.device, "fla.modules.causal_conv1d", "causal_conv1d")
    if fused is not None:
        y, _ = fused(x, weight.to(x.dtype), activation="silu")
        return y
    return short_conv_silu_torch(x, weight)
