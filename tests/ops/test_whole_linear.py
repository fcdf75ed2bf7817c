"""``WholeLinear`` (the tp=1 projection, k3train/ops/whole_linear.py) against megatron-core's
``ColumnParallelLinear`` / ``RowParallelLinear`` at tensor-parallel size 1, the layers it stands
in for: same weights from the same seed, same weight attributes, same state-dict keys, and
bitwise the same outputs and gradients."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from k3train.ops.whole_linear import WholeLinear


@pytest.fixture
def megatron_tp1():
    """megatron-core's own groups on a one-process gloo world (what a run made before)."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True,
                              params_dtype=torch.float32, sequence_parallel=False,
                              gradient_accumulation_fusion=False)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _pair(kind: str, config, in_f: int, out_f: int):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    init = functools.partial(nn.init.normal_, mean=0.0, std=0.02)
    torch.manual_seed(3)
    if kind == "column":
        ref = ColumnParallelLinear(in_f, out_f, config=config, init_method=init, bias=False, gather_output=False)
    else:
        ref = RowParallelLinear(in_f, out_f, config=config, init_method=init, bias=False,
                                input_is_parallel=True, skip_bias_add=False)
    next_ref = torch.rand(4)
    torch.manual_seed(3)
    ours = WholeLinear(in_f, out_f, partition_dim=0 if kind == "column" else 1, init_method=init)
    # the layers after this one draw the same numbers: the RNG advanced alike
    assert torch.equal(next_ref, torch.rand(4))
    return ref, ours


@pytest.mark.parametrize("kind", ["column", "row"])
def test_whole_linear_matches_megatron_tp1_bitwise(megatron_tp1, kind):
    ref, ours = _pair(kind, megatron_tp1, 24, 40)
    assert torch.equal(ref.weight, ours.weight)  # same draws from the global RNG
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce"):
        assert getattr(ours.weight, attr) == getattr(ref.weight, attr), attr
    assert ours.state_dict().keys() == ref.state_dict().keys() == {"weight", "_extra_state"}
    assert ours.state_dict()["_extra_state"] is None

    ref.double(), ours.double()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yo = ref(xr)[0], ours(xo)[0]
    assert ours(xo)[1] is None
    assert torch.equal(yr, yo)
    dy = torch.randn_like(yr)
    yr.backward(dy), yo.backward(dy)
    assert torch.equal(xr.grad, xo.grad) and torch.equal(ref.weight.grad, ours.weight.grad)
    # the weight gradient is dy^T x over the flattened positions (an independent check)
    torch.testing.assert_close(ours.weight.grad, dy.reshape(-1, 40).t() @ x.reshape(-1, 24), rtol=1e-12, atol=1e-12)


def test_frozen_weight_gives_input_grad_only(megatron_tp1):
    ref, ours = _pair("column", megatron_tp1, 8, 12)
    ref.weight.requires_grad_(False), ours.weight.requires_grad_(False)
    x = torch.randn(3, 8)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr)[0].sum().backward(), ours(xo)[0].sum().backward()
    assert torch.equal(xr.grad, xo.grad) and ours.weight.grad is None


def test_state_dicts_load_across(megatron_tp1):
    """A checkpoint of either layer loads into the other (strict), with or without the
    ``_extra_state`` entry (state dicts written before the entry existed)."""
    ref, ours = _pair("row", megatron_tp1, 8, 6)
    with torch.no_grad():
        ref.weight.add_(1.0)
    ours.load_state_dict(ref.state_dict())
    assert torch.equal(ours.weight, ref.weight)
    ours.load_state_dict({"weight": torch.zeros(6, 8)})  # strict, no _extra_state key
    assert not ours.weight.any()
    ref.load_state_dict(ours.state_dict())
    assert not ref.weight.any()
