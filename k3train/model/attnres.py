"""Block Attention Residuals (arXiv 2603.15031): attention over depth instead of a running sum.

Sources are the completed blocks [b_0 (embedding), ..., b_{n-1}] plus the current block's
partial sum b_n^{i-1} when it is non-empty. A sublayer's input is
    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i,
with w a zero-initialised learned pseudo-query per sublayer (so training starts from the
uniform average over sources). Computed in fp32: the softmax over depth is the residual path.

The depth weights are recorded only inside ``record_depth_weights(model)``, which hands back
what the forwards in its block recorded; outside it a forward leaves nothing behind.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

from k3train.ops.attnres import depth_mix, depth_mix_torch


class DepthWeights:
    """The AttnRes depth weights recorded by ``record_depth_weights``.

    weights: ``DepthAttention`` module -> ``[S]`` fp32 mean softmax weight it gave each source
    (source 0 is the embedding) in its last forward inside the block. A forward-state holder
    (k3train/model/forward_state.py): recompute and CUDA graphs snapshot it like the MoE records.
    """

    def __init__(self):
        self.weights: dict[DepthAttention, torch.Tensor] = {}

    def forward_state(self) -> dict:
        return {"weights": dict(self.weights)}

    def load_forward_state(self, state: dict) -> None:
        self.weights = dict(state["weights"])


class DepthAttention(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(hidden_size))
        # Set only inside record_depth_weights: where this module's forward records its weights.
        self.recorder: DepthWeights | None = None

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """sources: S tensors [B, T, D] -> [B, T, D] in the first source's dtype."""
        if self.recorder is not None:
            # The torch form: the fused kernel does not return the weights.
            out, weights = depth_mix_torch(self.query, sources, self.eps, return_weights=True)
            self.recorder.weights[self] = weights.detach().mean(dim=(1, 2))
            return out
        return depth_mix(self.query, sources, self.eps)


@contextmanager
def record_depth_weights(model: nn.Module) -> Iterator[DepthWeights]:
    """Record the depth weights of every ``DepthAttention`` in ``model`` during the block::

        with record_depth_weights(model) as rec:
            model(tokens)
        rec.weights[layer.mixer_res]        # [S] mean weight per source

    Recording runs the torch form of the depth mix (the fused kernel does not return weights);
    after the block the modules run as before and ``rec`` keeps what was recorded."""
    rec = DepthWeights()
    modules = [m for m in model.modules() if isinstance(m, DepthAttention)]
    for m in modules:
        m.recorder = rec
    try:
        yield rec
    finally:
        for m in modules:
            m.recorder = None
