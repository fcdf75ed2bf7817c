"""MX quantization-aware training: fake-quant forward, straight-through-estimator backward.

K3's ``mxfp4_qat`` recipe (docs/quantization.md): MXFP4 (E2M1) weights and MXFP8 (E4M3)
activations, blocks of 32 with E8M0 scales. MX hardware multiplies block by block along the
reduction dimension of a GEMM, so the blocks here always run along the reduction (input) axis.
Gradients are not quantized: the backward GEMMs use the fake-quantized operands saved by
autograd and high-precision gradients, and the quantizer itself is treated as the identity.
"""

import torch
import torch.nn.functional as F

from k3train.quant.mx import fake_quant_mx


class MXFakeQuant(torch.autograd.Function):
    """y = fake_quant_mx(x, elem, block_size); dy/dx := identity (straight-through estimator).

    The true derivative of rounding is zero almost everywhere, which would stop all learning;
    the STE passes the gradient through unchanged, including for saturated values (no clipping
    mask), matching the K3 recipe of plain STE.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, elem: str, block_size: int = 32) -> torch.Tensor:
        return fake_quant_mx(x, elem, block_size)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, None, None


def mx_fake_quant(x: torch.Tensor, elem: str, block_size: int = 32) -> torch.Tensor:
    """Differentiable (STE) fake-quant of x: [..., n], blocks along the last dim."""
    return MXFakeQuant.apply(x, elem, block_size)


def mx_qat_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_elem: str = "e2m1",
    act_elem: str = "e4m3",
    block_size: int = 32,
) -> torch.Tensor:
    """F.linear on MX fake-quantized operands.

    x: [..., in]; weight: [out, in]; bias: [out] or None -> [..., out].
    Both operands are blocked along ``in`` (the reduction dim): the last dim of each. Bias stays
    in high precision. Gradients: dx = dy @ q(W), dW = dy^T @ q(x) (STE through both quantizers).
    """
    wq = mx_fake_quant(weight, weight_elem, block_size)
    xq = mx_fake_quant(x, act_elem, block_size)
    return F.linear(xq, wq, bias)


def quantized_grouped_weight(
    w: torch.Tensor,
    layout: str = "in_out",
    elem: str = "e2m1",
    block_size: int = 32,
) -> torch.Tensor:
    """STE fake-quant of stacked expert weights, blocked along each expert's reduction dim.

    w: [E, in, out] with layout="in_out" (used as x_e @ w[e], the torch._grouped_mm ``mat2``
    convention): blocks run along dim 1 (``in``);
    w: [E, out, in] with layout="out_in" (used as x_e @ w[e].T, nn.Linear convention): blocks run
    along dim 2 (``in``).
    Returns a tensor of w's shape and dtype. The layout is named explicitly because a square
    expert weight would otherwise be ambiguous, and blocking along ``out`` would silently give
    a different (non-MX-GEMM) quantization.
    """
    if w.dim() != 3:
        raise ValueError(f"grouped expert weight must be 3-D [E, ., .]; got shape {tuple(w.shape)}")
    if layout == "out_in":
        return mx_fake_quant(w, elem, block_size)
    if layout == "in_out":
        # Move ``in`` last so blocks run along it, then restore the layout.
        return mx_fake_quant(w.transpose(1, 2), elem, block_size).transpose(1, 2)
    raise ValueError(f"unknown grouped weight layout {layout!r}; allowed: ['in_out', 'out_in']")
