"""Sigmoid top-k router with a selection-only bias (DeepSeek-V3 / K3 style)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from .topk import row_topk


@dataclass
class RouterOutput:
    """Routing decision for ``N`` tokens over ``E`` experts, top-``k``.

    scores:  ``[N, E]`` sigmoid(logits), without the bias. Outside autocast fp32 (fp64 for fp64
             inputs); under autocast the logit GEMM runs in the autocast dtype, so scores are
             bf16 in bf16 training (see ``SigmoidTopKRouter.forward``).
    indices: ``[N, k]`` int64 selected experts: top-k of ``scores + bias``, a sum promoted to
             the fp32 bias's dtype, so the selection compares in fp32 even for bf16 scores.
    weights: ``[N, k]`` scores at ``indices`` renormalised to sum to 1 per token (scores' dtype).
    logits:  ``[N, E]`` router logits, same dtype as scores.
    """

    scores: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor

    def detach(self) -> "RouterOutput":
        return RouterOutput(self.scores.detach(), self.indices.detach(),
                            self.weights.detach(), self.logits.detach())

    @staticmethod
    def cat(outputs: list["RouterOutput"]) -> "RouterOutput":
        """Concatenate the decisions for several token sets along N."""
        if len(outputs) == 1:
            return outputs[0]
        return RouterOutput(*(torch.cat([getattr(o, f) for o in outputs])
                              for f in ("scores", "indices", "weights", "logits")))


class SigmoidTopKRouter(nn.Module):
    """Linear ``d -> E`` (no bias) + sigmoid + top-k on ``scores + bias``.

    Attributes:
        weight: ``[E, d]`` parameter.
        bias:   ``[E]`` fp32 persistent buffer, written in place by a balancer outside autograd.
            It only shifts which experts are selected; the mixing weights come from the unbiased
            scores, so balancing never changes how much an expert's output counts.
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, init_std: float = 0.02):
        super().__init__()
        if not 0 < topk <= num_experts:
            raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
        self.hidden_size, self.num_experts, self.topk = hidden_size, num_experts, topk
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        self.bias.zero_()

    def _apply(self, fn, recurse=True):
        # model.to(bf16) would round the bias to 8 mantissa bits, far coarser than the small
        # updates balancers make: keep it in fp32 (or fp64), only following the device.
        bias = self.bias
        super()._apply(fn, recurse)
        if self.bias.dtype not in (torch.float32, torch.float64):
            self.bias = bias.to(device=self.bias.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x: ``[N, d]`` -> RouterOutput (see its docstring for shapes)."""
        # Routing in (at least) fp32 outside autocast: bf16 logits create score ties and flip
        # near-equal selections. fp64 inputs stay fp64 so that reference tests can be exact.
        # Under autocast F.linear runs in the autocast dtype whatever its inputs' dtype, so the
        # logits (and the scores and weights after them) are bf16 there either way; casting x
        # up first only added two [N, d] copies each way for the same result (measured: see
        # benchmarks/README.md).
        if torch.is_autocast_enabled(x.device.type):
            logits = F.linear(x, self.weight)
        else:
            dtype = torch.promote_types(x.dtype, torch.float32)
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        scores = torch.sigmoid(logits)
        # The bias only picks experts; no gradient flows through the selection.
        indices = row_topk(scores.detach(), self.topk, self.bias)[1]
        picked = scores.gather(-1, indices)
        weights = picked / picked.sum(dim=-1, keepdim=True)
        return RouterOutput(scores=scores, indices=indices, weights=weights, logits=logits)
