"""The projection of a ``parallel.tp == 1`` run: megatron-core's tensor-parallel linears at
size 1, without importing megatron-core (seconds of start-up, k3train/runtime/distributed.py).

It matches what ``ColumnParallelLinear`` / ``RowParallelLinear`` do at tensor-parallel size 1
with CPU initialisation, so a run, its checkpoints and its numbers are the same whichever
builds the layer (tests/ops/test_whole_linear.py compares them):

- initialisation: one ``init_method`` call on a fresh fp32 ``[out, in]`` tensor, copied into the
  weight (the same draws from the global RNG);
- the weight's attributes ``tensor_model_parallel``, ``partition_dim`` (0 for a column layer,
  1 for a row layer), ``partition_stride`` and ``allreduce``, which gradient-norm and
  resharding code read;
- the state dict: ``weight`` and an ``_extra_state`` of None (supplied when a state dict
  lacks it);
- the arithmetic: forward ``x @ W^T``; backward ``dx = dy @ W`` and
  ``dW = dy_2d^T @ x_2d`` (contiguous, leading dims flattened), under the forward's CUDA
  autocast state (``torch.amp.custom_fwd`` / ``custom_bwd``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn


class _Matmul(torch.autograd.Function):
    """``y[..., out] = x[..., in] @ weight[out, in]^T`` with the backward written out."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.matmul(x, weight.t())

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight)
        grad_w = None
        if ctx.needs_input_grad[1]:
            g2 = grad_out.contiguous()
            x2 = x.contiguous()
            if g2.dim() > 2:  # [B, T, n] -> [B*T, n]
                g2, x2 = g2.reshape(-1, g2.shape[-1]), x2.reshape(-1, x2.shape[-1])
            grad_w = g2.t().matmul(x2)
        return grad_x, grad_w


class WholeLinear(nn.Module):
    """A bias-free linear whose weight ``[out, in]`` is whole on this rank.

    partition_dim: 0 where it stands for a column-parallel layer, 1 for a row-parallel one
        (only recorded on the weight, as megatron-core records it).
    init_method: fills the fp32 ``[out, in]`` master weight in place.
    ``forward(x [..., in]) -> (y [..., out], None)``: megatron-core's ``(output, bias)`` pair.
    """

    def __init__(self, in_features: int, out_features: int, *, partition_dim: int,
                 init_method: Callable[[torch.Tensor], Any]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32))
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, partition_dim
        self.weight.partition_stride, self.weight.allreduce = 1, True
        master = torch.empty(out_features, in_features, dtype=torch.float32, requires_grad=False)
        init_method(master)
        with torch.no_grad():
            self.weight.copy_(master)
        # Checkpoints written by megatron-core's layers and by this one carry the key.
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Matmul.apply(x, self.weight), None

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state: Any) -> None:
        pass

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False, TP=1"
