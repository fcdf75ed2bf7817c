"""train.recompute composes with every CPU-runnable layout and precision recipe.

Reference: recompute=none at the *same* layout (same ranks, seed and batches). Recompute runs
the same ops in the same order on the same inputs (the collectives of a recomputed forward
carry the same tensors), so on CPU fp32 the loss, every local gradient of the first step and
every parameter after two optimizer steps must be bitwise equal (rtol = atol = 0).

Layouts (gloo ranks): pipeline P=4 with V=2 (8 chunks of one layer, AttnRes blocks of 3 that
cross chunk ends, 4 microbatches); expert parallel ep=2; tensor parallel tp=2; ZeRO-1
(optim.zero1, Muon and AdamW) at dp=2. Recipes: bf16 (fp32 on CPU), fp32, mxfp8 and
mxfp4_qat (fake-quantised, straight-through); fp8 needs a CUDA GPU (refused on CPU).
"""
from __future__ import annotations

import pytest
import torch

from k3train.config import load_config
from k3train.runtime.distributed import init_distributed
from k3train.trainer.state import TrainState
from tests.multiproc import run_multiprocess

EXACT = dict(rtol=0, atol=0)
MODES = ["selective", "full"]

# A tiny K3: KDA and MLA layers, one dense layer then MoE (latent 32 so MX blocks of 32 fit).
TINY = ["model.hidden_size=32", "model.kda.num_heads=2", "model.kda.head_dim=8",
        "model.mla.num_heads=2", "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16",
        "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8",
        "model.ffn.intermediate_size=32", "moe.num_experts=4", "moe.latent_size=32",
        "moe.expert_ffn_size=32", "moe.shared_ffn_size=32", "model.layer_pattern=KM",
        "model.dense_layers=1", "model.attnres.enabled=true", "model.attnres.block_size=3",
        "train.seq_len=8", "train.micro_batch_size=2", "moe.balancing=quantile"]


def _state(mode: str, overrides: list[str]) -> TrainState:
    cfg = load_config(None, [*TINY, f"train.recompute={mode}", *overrides])
    p = cfg.parallel
    info = init_distributed(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep)
    torch.manual_seed(0)
    return TrainState(cfg, info, torch.device("cpu"))


def _run(mode: str, overrides: list[str], rank: int):
    """First step's loss and local gradients (before any reduction), then the parameters after
    two full training steps. Each DP rank draws its own batches."""
    state = _state(mode, overrides)
    cfg = state.cfg.train
    gen = torch.Generator().manual_seed(100 + state.parallel.dp_rank)
    batches = [torch.randint(0, 257, (cfg.micro_batch_size * cfg.microbatches, cfg.seq_len + 1),
                             generator=gen) for _ in range(2)]
    loss = state._forward_backward(batches[0]).clone()
    grads = [None if p.grad is None else p.grad.clone() for p in state.params]
    state.optimizer.zero_grad(set_to_none=True)
    for layer in state.moe_layers:
        layer.routing.clear()
    stats = [state.train_step(b) for b in batches]
    return loss, grads, [s["loss"] for s in stats], [p.detach().clone() for p in state.params]


def _matches_none(rank, world_size, modes, overrides):
    """Each of ``modes`` against one ``none`` run of the same layout (one launch for all)."""
    ref = _run("none", overrides, rank)
    for mode in modes:
        _compare(rank, mode, _run(mode, overrides, rank), ref)


def _compare(rank, mode, got, ref):
    torch.testing.assert_close(got[0], ref[0], **EXACT)
    assert len(got[1]) == len(ref[1]) > 0
    for i, (g, r) in enumerate(zip(got[1], ref[1])):
        assert (g is None) == (r is None), i
        if r is not None:
            torch.testing.assert_close(g, r, **EXACT, msg=lambda s: f"rank {rank} {mode} grad {i}: {s}")
    assert got[2] == ref[2], (got[2], ref[2])
    for i, (p, q) in enumerate(zip(got[3], ref[3], strict=True)):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda s: f"rank {rank} {mode} param {i}: {s}")


LAYOUTS = {
    # 8 chunks of one layer; the interleaved schedule needs at least P microbatches.
    "pp4-vpp2": (["parallel.pp=4", "parallel.vpp=2", "model.num_layers=8", "train.microbatches=4"], 4),
    "ep2": (["parallel.ep=2", "model.num_layers=4"], 2),
    "tp2": (["parallel.tp=2", "model.num_layers=4"], 2),
    "zero1-muon-dp2": (["optim.zero1=true", "optim.name=muon", "model.num_layers=4"], 2),
    "zero1-adamw-ep2": (["optim.zero1=true", "optim.name=adamw", "parallel.ep=2", "model.num_layers=4"], 2),
}


@pytest.mark.slow   # 2-4 gloo processes, three models each (none, then every mode)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recompute_matches_none_at_the_same_layout(layout):
    overrides, world = LAYOUTS[layout]
    run_multiprocess(_matches_none, world, MODES, overrides)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp32", "mxfp8", "mxfp4_qat"])
def test_recompute_matches_none_under_each_cpu_recipe(world1, recipe):
    """One process; the MX recipes' fake quantisation is deterministic, so its recompute is too."""
    overrides = [f"precision.recipe={recipe}", "model.num_layers=4", "train.microbatches=2"]
    _matches_none(0, 1, MODES, overrides)


def test_fp8_is_refused_on_cpu():
    """The one recipe that cannot run here says so (so the CPU list above is complete)."""
    from k3train.errors import UsageError

    with pytest.raises(UsageError, match="precision.recipe=fp8 needs a CUDA GPU"):
        _state("full", ["precision.recipe=fp8", "model.num_layers=2"])
