"""RMSNorm with fp32 math whose output is already in the dtype its consumer GEMMs run in.

Under autocast a norm's fp32 output would be cast to bf16 by every Linear that reads it, once
per consumer (a KDA input feeds five projections, a LatentMoE input three), and each cast's
backward adds an fp32 gradient copy. Emitting the autocast dtype here makes that one cast,
fused into the norm kernel on CUDA. Outside autocast the output keeps the input's dtype, so
CPU runs and fp32 reference runs are unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from .compile import compile_on_cuda


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a GEMM on ``x``'s device in, or None outside autocast."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """x ``[..., D]``, weight ``[D]`` or None -> ``x / rms(x) * weight`` ``[..., D]`` in
    ``out_dtype``; the mean of squares and the scaling run in fp32 (or wider, for fp64 inputs,
    as bf16 sums of squares drift)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(ct)
    return y.to(out_dtype)


# One kernel forward (read bf16/fp32, write the GEMM dtype) and one or two backward, instead of
# an upcast copy, the norm and a downcast copy each way. Dynamic shapes: a model has norms of
# several widths (hidden, MLA ranks, MoE latent), and not fullgraph, so that past Dynamo's
# recompile limit (e.g. many models in one process) it runs eagerly, not fails. Outside
# autocast: every cast is explicit (``out_dtype`` is read from autocast before the call), and
# autocast as a guard made one compile per autocast state, which hit the recompile limit in
# k3_mini's first step.
_RMS_NORM_COMPILE = {"dynamic": True, "outside_autocast": True}
_rms_norm = compile_on_cuda(rms_norm_eager, **_RMS_NORM_COMPILE)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learnable weight ``[D]``, computed in (at least) fp32.

    ``[..., D] -> [..., D]`` in the autocast dtype under autocast (see the module docstring),
    else in the input's dtype.
    """

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Contiguous rows [N, D] and a view of the weight, so that one compiled graph per grad
        # mode serves every width, rank and layout: Dynamo keeps a Parameter's shape static
        # (which pinned D, and with it x's last dim, to each norm's width), a [B, T, D] and a
        # [N, D] input were two graphs, and the rows' layout is guarded too: contiguous rows, a
        # slice's strided rows (MLA normalises a slice of its down-projection) and rows at an
        # offset into another base were three graphs per grad mode, 6 of Dynamo's 8, and the
        # evaluation's forwards then reached the limit on an H200 (issue 40). A strided slice
        # is copied once here (only MLA's latent, narrower than the hidden width); every call
        # then presents the same layout: one graph per grad mode
        # (tests/moe/test_norm_recompiles.py).
        D = x.shape[-1]
        # Never a view: Dynamo guards a view input on its base's shape and strides, and the
        # bases differ between the training and the evaluation forwards. ``_unsafe_view`` is
        # reshape's own non-view alias (no copy; its backward reshapes the gradient back).
        rows = torch.ops.aten._unsafe_view(x if x.is_contiguous() else x.contiguous(), [x.numel() // D, D])
        out = _rms_norm(rows, self.weight.view(-1), self.eps, autocast_dtype(x) or x.dtype)
        return out.view(x.shape)
