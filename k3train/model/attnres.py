"""Block Attention Residuals (arXiv 2603.15031): attention over depth instead of a running sum.

Sources are the completed blocks [b_0 (embedding), ..., b_{n-1}] plus the current block's
partial sum b_n^{i-1} when it is non-empty. A sublayer's input is
    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i,
with w a zero-initialised learned pseudo-query per sublayer (so training starts from the
uniform average over sources). Computed in fp32: the softmax over depth is the residual path.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from k3train.ops.attnres import depth_mix, depth_mix_torch


class DepthAttention(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.record = False
        self.last_weights: torch.Tensor | None = None  # [S] mean weight per source, when recording

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """sources: S tensors [B, T, D] -> [B, T, D] in the first source's dtype."""
        if self.record:
            out, weights = depth_mix_torch(self.query, sources, self.eps, return_weights=True)
            self.last_weights = weights.detach().mean(dim=(1, 2))
            return out
        return depth_mix(self.query, sources, self.eps)
