"""Per-head RMSNorm times a sigmoid gate (the KDA output norm), compiled into one kernel on CUDA."""
from __future__ import annotations

import functools

import torch

from k3train.ops import backends as ops_backends
from k3train.ops.layers import rms_norm
from moe.compile import autocast_free

__all__ = ["head_norm_gate", "head_norm_gate_torch"]


def head_norm_gate_torch(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """o ``[B, T, H, K]``, weight ``[H, K]``, gate logits ``[B, T, H, K]`` ->
    ``rms_norm_K(o) * weight * sigmoid(gate)`` in ``o.dtype`` (norm in fp32 at least)."""
    return rms_norm(o, weight, eps) * torch.sigmoid(gate).to(o.dtype)


@functools.cache
def _compiled():
    # One fused elementwise kernel forward and one backward instead of about ten passes over
    # [B, T, H, K]; kernels.compile=false turns it off (debugging, or a torch without Inductor).
    return torch.compile(head_norm_gate_torch, dynamic=False, fullgraph=True)


def head_norm_gate(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``head_norm_gate_torch``, through ``torch.compile`` on CUDA (same shapes and result)."""
    if o.device.type == "cuda" and ops_backends.current().compile:
        # Entered with autocast off (its casts are explicit; sigmoid and products are not
        # autocast ops): autocast state would otherwise be a Dynamo guard, one compile per state.
        with autocast_free(o.device.type):
            return _compiled()(o, weight, gate, eps)
    return head_norm_gate_torch(o, weight, gate, eps)
