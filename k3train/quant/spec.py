"""What a quantised layer is given at build time: a ``QuantSpec`` and the ``MXLinear`` layer.

A spec names the element formats and block size; its methods are the hooks the layers take
(``GroupedExperts(weight_quant=..., act_quant=...)``, ``ColumnLinear(quant=...)``), so the
layers never import this package. Every hook blocks along the GEMM's reduction dimension, as
MX hardware does, and passes gradients straight through (``k3train.quant.qat``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from k3train.quant.qat import mx_fake_quant, mx_qat_linear, quantized_grouped_weight


@dataclass(frozen=True)
class QuantSpec:
    """MX fake-quant recipe: ``weight_elem`` / ``act_elem`` in {"e2m1", "e4m3"}, E8M0 scales."""

    weight_elem: str
    act_elem: str
    block_size: int = 32

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., K], blocks along the last (reduction) dim."""
        return mx_fake_quant(x, self.act_elem, self.block_size)

    def grouped_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Stacked expert weight w: [E, K, N] used as ``x_e @ w[e]`` -> [E, K, N], blocks along K."""
        return quantized_grouped_weight(w, "in_out", self.weight_elem, self.block_size)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in]; weight: [out, in] -> [..., out]; both blocked along ``in``."""
        return mx_qat_linear(x, weight, bias, self.weight_elem, self.act_elem, self.block_size)


MX_SPECS = {
    "mxfp4_qat": QuantSpec("e2m1", "e4m3", 32),  # K3: MXFP4 weights, MXFP8 activations
    "mxfp8": QuantSpec("e4m3", "e4m3", 32),
}


class MXLinear(nn.Linear):
    """``nn.Linear`` whose forward runs on MX fake-quantised weight and input (STE backward).

    Parameter names (``weight``, ``bias``) are those of nn.Linear, so checkpoints move freely
    between a quantised and a full-precision model.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 spec: QuantSpec, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.spec = spec

    @classmethod
    def from_linear(cls, lin: nn.Linear, spec: QuantSpec) -> "MXLinear":
        """Same Parameter objects as ``lin`` (ties such as a tied head survive), new forward."""
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, spec=spec, device="meta")
        new.weight = lin.weight
        new.bias = lin.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spec.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        s = self.spec
        return f"{super().extra_repr()}, mx weight={s.weight_elem} act={s.act_elem} block={s.block_size}"
