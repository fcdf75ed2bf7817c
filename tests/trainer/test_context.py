"""The run context: built once from the parallel groups, the device and the kernel choices,
frozen, and the model's MoE dispatchers take its expert group instead of asking
megatron-core's ``parallel_state``."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from k3train.config import load_config
from k3train.model.model import build_dispatcher, build_model
from k3train.ops import kernels
from k3train.trainer.context import RunContext
from k3train.runtime.distributed import parallel_context, shutdown_distributed
from moe import GroupedAllToAllDispatcher


def test_the_context_is_frozen_and_folds_in_the_parallel_info(world1):
    parallel = parallel_context(world1)
    ctx = RunContext(parallel=parallel, device=torch.device("cpu"), kernels=kernels.current())
    assert ctx.info is world1 and ctx.info.world_size == 1 and ctx.parallel.dp_rank == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.device = torch.device("meta")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.kernels.autotune = "fixed"
    with pytest.raises(TypeError):  # the per-family choices are a read-only mapping
        ctx.kernels.families["router_topk"] = "torch"


def test_the_dispatchers_take_the_contexts_expert_group(world1):
    parallel = parallel_context(world1)
    cfg = load_config("configs/k3_tiny.yaml", ["moe.dispatcher=grouped_a2a"])
    model = build_model(cfg, ep_group=parallel.ep_group)
    dispatchers = [layer.ffn.dispatcher for layer in model.layers if hasattr(layer.ffn, "dispatcher")]
    assert dispatchers and all(isinstance(d, GroupedAllToAllDispatcher) for d in dispatchers)
    assert all(d.group is parallel.ep_group and d.ep_size == 1 for d in dispatchers)


def test_without_a_context_the_dispatchers_take_megatrons_group_where_it_exists(world1):
    """Builders that hold no run context (model-info, the HF and MXFP4 translators) get
    megatron-core's expert group where the groups exist, never the world group."""
    cfg = load_config("configs/k3_tiny.yaml", ["moe.dispatcher=grouped_a2a"])
    assert build_dispatcher(cfg).group is parallel_context(world1).ep_group
    shutdown_distributed()
    assert build_dispatcher(cfg).group is None and build_dispatcher(cfg).ep_size == 1
