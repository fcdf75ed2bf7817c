"""Block AttnRes mixing (softmax over depth) with backend dispatch.

``depth_mix(query, sources)`` computes, for sources v_1..v_S ``[..., D]``,
    sum_i softmax_i(query . RMSNorm(v_i)) v_i          (RMSNorm without weight, fp32 math)
On CUDA tensors, where the kernel registry picks fla (``kernels.attnres``), it runs fla's fused Triton kernel (one read of every source
forward, no stacked copy, recompute in backward); elsewhere the pure-torch form below, which is
also the reference the GPU check compares against.
"""
from __future__ import annotations

import functools

import torch

from k3train.ops.layers import rms_norm
from k3train.ops import fla_kernel

__all__ = ["attnres_backend", "depth_mix", "depth_mix_torch"]


def attnres_backend(device: torch.device | str) -> str:
    """Which implementation ``depth_mix`` runs for tensors on ``device``: ``"fla"`` or ``"torch"``."""
    return "fla" if fla_kernel("attnres", device, "fla.ops.attnres", "fused_attnres") is not None else "torch"


def depth_mix_torch(query: torch.Tensor, sources: list[torch.Tensor], eps: float,
                    return_weights: bool = False):
    """Reference form. query ``[D]``; sources S x ``[B, T, D]`` -> ``[B, T, D]`` in the first
    source's dtype (and the weights ``[S, B, T]`` when asked)."""
    v = torch.stack(sources)
    v = v.to(torch.promote_types(v.dtype, torch.float32))  # [S, B, T, D]
    logits = (rms_norm(v, None, eps) * query.to(v.dtype)).sum(-1)  # [S, B, T]
    weights = torch.softmax(logits, dim=0)
    out = (weights.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)
    return (out, weights) if return_weights else out


def depth_mix(query: torch.Tensor, sources: list[torch.Tensor], eps: float) -> torch.Tensor:
    """``depth_mix_torch`` on the fastest backend for the sources' device (same shapes)."""
    fused = fla_kernel("attnres", sources[0].device, "fla.ops.attnres", "fused_attnres")
    if fused is None:
        return depth_mix_torch(query, sources, eps)
    # The kernel wants one dtype: under autocast a fresh partial sum is bf16 while the embedding
    # and completed blocks are fp32; mix in the widest, as the reference does.
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in sources))
    srcs = [s if s.dtype == dtype else s.to(dtype) for s in sources]
    ones = torch.ones(query.shape[-1], device=query.device, dtype=torch.float32)
    out = fused(query, srcs, ones, None, rms_eps=eps)
    return out.to(sources[0].dtype)
