"""Pieces shared by every sublayer: RMSNorm and the tensor-parallel linear wrappers.

Projections are megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` so that
``parallel.tp > 1`` shards heads and FFN width; at ``parallel.tp == 1`` the same layer is
``k3train.ops.whole_linear.WholeLinear`` (megatron-core is then never imported). They are built
with CPU initialisation: the full master weight is drawn from the global RNG on every rank and
each rank keeps its slice, so a TP=2 model holds exactly the weights of the TP=1 model with the
same seed.

``ColumnLinear`` / ``RowLinear`` take an optional ``quant`` function ``(x [..., in],
weight [out, in]) -> [..., out]`` that replaces the matmul (MX fake-quant QAT, chosen by
``precision.scope`` at build time; see ``k3train.quant.recipes``). It computes the unsharded
product, so it is only valid at ``parallel.tp == 1``; the recipe code refuses it otherwise.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn
from k3train.errors import LayoutError
from k3train.ops.whole_linear import WholeLinear
from k3train.runtime.distributed import tensor_parallel_group, tensor_parallel_rank, tensor_parallel_size
from moe.layer import RMSNorm  # noqa: F401 - one RMSNorm module for the model and the MoE layer
from moe.norm import rms_norm_eager


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim in x's dtype, computed in fp32 or wider
    (``moe.norm.rms_norm_eager``, the same math the RMSNorm module compiles)."""
    return rms_norm_eager(x, weight, eps, x.dtype)


def tp_size() -> int:
    return tensor_parallel_size()


def tp_rank() -> int:
    return tensor_parallel_rank()


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise LayoutError(f"{what} ({total}) must be divisible by parallel.tp ({parts})")
    return total // parts


@functools.lru_cache(maxsize=8)
def _mp_config(tp: int):
    from megatron.core.model_parallel_config import ModelParallelConfig  # tp > 1 only

    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        sequence_parallel=False,
        gradient_accumulation_fusion=False,
    )


LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _normal(std: float):
    return functools.partial(nn.init.normal_, mean=0.0, std=std)


class _TPLinear(nn.Module):
    """A megatron-core tensor-parallel linear without bias (``WholeLinear`` at tp=1), returning
    only the output.

    quant: optional ``(x, weight) -> y`` replacing the matmul (QAT recipes, tp=1 only).
    """

    def __init__(self, inner: nn.Module, quant: LinearFn | None):
        super().__init__()
        self.quant, self.inner = quant, inner

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x, self.inner.weight)
        return self.inner(x)[0]


class ColumnLinear(_TPLinear):
    """``y[..., out/tp] = x[..., in] @ W^T``: output features sharded over tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, std: float,
                 quant: LinearFn | None = None):
        if tp_size() == 1:
            inner = WholeLinear(in_features, out_features, partition_dim=0, init_method=_normal(std))
        else:
            from megatron.core.tensor_parallel import ColumnParallelLinear

            inner = ColumnParallelLinear(
                in_features, out_features, config=_mp_config(tp_size()), init_method=_normal(std),
                bias=False, gather_output=False)
        super().__init__(inner, quant)


class RowLinear(_TPLinear):
    """``y[..., out] = sum over tp of x[..., in/tp] @ W_shard^T``: input features sharded."""

    def __init__(self, in_features: int, out_features: int, std: float,
                 quant: LinearFn | None = None):
        if tp_size() == 1:
            inner = WholeLinear(in_features, out_features, partition_dim=1, init_method=_normal(std))
        else:
            from megatron.core.tensor_parallel import RowParallelLinear

            inner = RowParallelLinear(
                in_features, out_features, config=_mp_config(tp_size()), init_method=_normal(std),
                bias=False, input_is_parallel=True, skip_bias_add=False)
        super().__init__(inner, quant)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over tensor-parallel ranks.

    For a replicated tensor that feeds only this rank's heads. (megatron-core's
    ``copy_to_tensor_model_parallel_region`` reduces ``grad.contiguous()`` but returns the
    original grad, so a non-contiguous gradient comes back unreduced; we own this one.)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=tensor_parallel_group())
        return grad


def sum_grad_over_tp(x: torch.Tensor) -> torch.Tensor:
    return _SumGradOverTP.apply(x) if tp_size() > 1 else x


def replicated_linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    """A plain linear that every tensor-parallel rank holds whole (small low-rank projections)."""
    lin = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(lin.weight, std=std)
    return lin


def sharded_param(full: torch.Tensor, parts: int, rank: int) -> nn.Parameter:
    """This rank's contiguous slice of dim 0 (heads / channels) as a Parameter.

    Marked ``tensor_model_parallel`` like megatron-core's sharded weights, so that gradient-norm
    code sums it over tensor-parallel ranks instead of counting it as a replica.
    """
    p = nn.Parameter(full.chunk(parts, dim=0)[rank].clone())
    p.tensor_model_parallel, p.partition_dim = True, 0
    return p
