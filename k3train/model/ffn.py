"""Dense SiTU-GLU feed-forward: down(SiTU(gate x) * beta_lin*tanh(up x / beta_lin)).

SiTU(g) = beta * tanh(g / beta) * sigmoid(g) bounds the gate branch; the soft cap on the up
branch bounds the product, which is what keeps K3's activations stable at scale.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from k3train.ops.layers import ColumnLinear, RowLinear, divide, tp_size
from moe.activations import situ_glu


class SiTUGLU(nn.Module):
    def __init__(self, *, hidden_size: int, intermediate_size: int, beta: float = 4.0,
                 beta_lin: float = 25.0, std: float = 0.02, out_std: float | None = None):
        super().__init__()
        divide(intermediate_size, tp_size(), "model.ffn.intermediate_size")
        self.beta, self.beta_lin = beta, beta_lin
        self.gate_proj = ColumnLinear(hidden_size, intermediate_size, std)
        self.up_proj = ColumnLinear(hidden_size, intermediate_size, std)
        self.down_proj = RowLinear(intermediate_size, hidden_size, out_std or std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        h = situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.beta_lin)
        return self.down_proj(h)
