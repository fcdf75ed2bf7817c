"""The memory planner's offload term (train.offload_activations) against what the hooks copied.

Reference: the bytes ``ActivationOffload`` actually copied to the host during a forward on CPU
(every saved tensor counted, ``min_bytes=0``), fp32. Under ``full`` a region keeps exactly its
inputs (under offload a layer is two regions, so its mixer half's output is one more), so the
planner's host bytes must equal the measured ones; under ``selective`` (the
cores' saved tensors too) within the planner's 15% on activations.
"""
from __future__ import annotations

import pytest
import torch

from k3train.model.model import build_model
from k3train.profiling.memory_plan import plan_memory
from tests.helpers import tiny_cfg

B, T = 2, 32


def _cfg(mode: str, attnres: bool, offload: bool):
    return tiny_cfg("model.layer_pattern=KM", "model.num_layers=4", "model.dense_layers=1",
                    "model.hidden_size=64", "model.kda.head_dim=16", "model.kda.chunk_size=16",
                    f"model.attnres.enabled={attnres}", "model.attnres.block_size=2",
                    f"train.recompute={mode}", f"train.offload_activations={offload}",
                    f"train.micro_batch_size={B}", f"train.seq_len={T}")


def _copied_bytes(cfg) -> int:
    model = build_model(cfg)
    model.offload.min_bytes = 0
    tokens = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:])
    return model.offload.stats.offloaded_bytes


@pytest.mark.parametrize("attnres", [True, False], ids=["attnres", "standard"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_planned_host_bytes_match_what_the_hooks_copied(world1, mode, attnres):
    cfg = _cfg(mode, attnres, True)
    measured = _copied_bytes(cfg)
    (plan,) = plan_memory(cfg, ops="torch", act_bytes=4)
    if mode == "full":
        assert plan.host_offload["full"] == measured
    else:
        assert plan.host_offload["selective"] == pytest.approx(measured, rel=0.15)
    # The device keeps less than without offload; "none" (refused with offload) is unchanged.
    (base,) = plan_memory(_cfg(mode, attnres, False), ops="torch", act_bytes=4)
    assert "none" not in plan.host_offload
    assert plan.peak_activations[mode] < base.peak_activations[mode]
    assert plan.peak_activations["none"] == base.peak_activations["none"]
