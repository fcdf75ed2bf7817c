"""train.recompute (k3train/model/recompute.py) against train.recompute=none.

Reference: the same model (same seed) without recompute. On CPU fp32 the recomputed forward
runs the same ops in the same order on the same inputs, so losses and gradients must be
bitwise equal (rtol = atol = 0); so must the balancer and load-tracker state after a step.
Memory: bytes of the distinct storages autograd keeps for backward (saved tensors, seen through
``saved_tensors_hooks``; a checkpoint region's placeholders are not storages), a deterministic
proxy for the activation part of peak memory.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from k3train.runtime.distributed import init_distributed
from k3train.model.model import K3Chunk, build_model
from k3train.trainer.state import TrainState
from pipeline import PipelineEngine, PipelineLayout
from k3train.model.model import produced_blocks
from tests.helpers import tiny_cfg
from tests.multiproc import run_multiprocess

EXACT = dict(rtol=0, atol=0)
MODES = ["selective", "full"]


def _cfg(mode: str, attnres: bool, *extra):
    # KDA and MLA layers, one dense SiTU-GLU layer then MoE layers; AttnRes blocks of 2 layers.
    return tiny_cfg("model.layer_pattern=KM", "model.dense_layers=1",
                     f"model.attnres.enabled={attnres}", "model.attnres.block_size=2",
                     f"train.recompute={mode}", *extra)


def _tokens():
    return torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(3))


class _SavedBytes:
    """Bytes of the distinct storages saved for backward while active."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t):
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _run(cfg, tokens):
    model = build_model(cfg)
    saved = _SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return model, loss.detach(), grads, saved.total


@pytest.mark.slow   # ~7 s per case on the shared 2-core machine
@pytest.mark.parametrize("balancing", ["quantile", "aux_loss"])
@pytest.mark.parametrize("attnres", [True, False], ids=["attnres", "standard"])
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_every_gradient_equal_none(world1, mode, attnres, balancing):
    tokens = _tokens()
    ref_model, ref_loss, ref_grads, _ = _run(_cfg("none", attnres, f"moe.balancing={balancing}"), tokens)
    model, loss, grads, _ = _run(_cfg(mode, attnres, f"moe.balancing={balancing}"), tokens)
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert g is not None, name
        torch.testing.assert_close(grads[name], g, **EXACT, msg=lambda s: f"{mode} {name}: {s}")
    # Routing recorded once per forward (not again by the recompute), and the same decisions.
    for layer, ref in zip(model.moe_layers(), ref_model.moe_layers(), strict=True):
        assert len(layer.routing.step) == len(ref.routing.step) == 1
        torch.testing.assert_close(layer.routing.step_routing().indices, ref.routing.step_routing().indices, **EXACT)
        torch.testing.assert_close(layer.routing.step_routing().scores, ref.routing.step_routing().scores, **EXACT)
        assert (layer.routing.aux_loss is None) == (ref.routing.aux_loss is None)
        if ref.routing.aux_loss is not None:
            torch.testing.assert_close(layer.routing.aux_loss, ref.routing.aux_loss, **EXACT)


def _train_two_steps(cfg):
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device="cpu"), torch.device("cpu"))
    batch = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    stats = [state.train_step(batch) for _ in range(2)]
    return state, stats


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_balancer_and_load_tracker_see_each_forward_once(mode):
    """Two steps of 2 microbatches with Quantile Balancing: router biases (set from the step's
    routing), the load tracker's totals and the weights equal those of recompute=none.
    Early stop off: with it on, torch stops the recompute at the layer's last saved tensor, before
    the MoE layer records its routing, which would hide a missing guard."""
    extra = ["model.attnres.enabled=true", "moe.balancing=quantile", "train.micro_batch_size=2",
             "train.microbatches=2", "train.seq_len=16"]
    ref, ref_stats = _train_two_steps(_cfg("none", True, *extra))
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        state, stats = _train_two_steps(_cfg(mode, True, *extra))
    assert [s["loss"] for s in stats] == [s["loss"] for s in ref_stats]
    for layer, ref_layer in zip(state.moe_layers, ref.moe_layers, strict=True):
        assert ref_layer.router.bias.abs().sum() > 0          # the balancer did move it
        torch.testing.assert_close(layer.router.bias, ref_layer.router.bias, **EXACT)
    for load, ref_load in zip(state.moe_stats.tracker._total_load, ref.moe_stats.tracker._total_load, strict=True):
        torch.testing.assert_close(load, ref_load, **EXACT)
    for p, q in zip(state.params, ref.params, strict=True):
        torch.testing.assert_close(p, q, **EXACT)


def test_saved_bytes_full_below_selective_below_none(world1):
    """Bytes kept for backward: full keeps only each layer's inputs (and the head's), selective
    adds the cores' own saved tensors and outputs, none keeps everything. The AttnRes blocks are
    region inputs: under full the total is at most the layers' inputs plus the embedding/head."""
    tokens = _tokens()
    cfg = _cfg("none", True, "model.num_layers=4")
    saved = {mode: _run(_cfg(mode, True), tokens)[3] for mode in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"], saved
    # Measured here: none 2.45 MB, selective 1.80 MB, full 0.14 MB (-94%).
    assert saved["full"] < 0.1 * saved["none"], saved
    B, T, D = 2, 16, cfg.model.hidden_size
    act = B * T * D * 4
    # Per layer at most: hidden/partial + every block so far; head: logits in fp32 twice.
    bound = cfg.model.num_layers * (1 + cfg.model.num_layers) * act + 3 * B * T * cfg.model.vocab_size * 4
    assert saved["full"] <= bound, (saved, bound)


def test_eval_forward_is_plain(world1):
    """Without grad there is nothing to recompute: the same logits and no region state."""
    tokens = _tokens()
    ref = build_model(_cfg("none", True))
    model = build_model(_cfg("full", True))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens[:, :-1]), ref(tokens[:, :-1]), **EXACT)


# ---- pipeline: P=2, V=2 on gloo ranks ------------------------------------------------------

def _pp_rank(rank, world_size, mode):
    init_distributed(pp=2)
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    layout = PipelineLayout(8, 2, 2)   # 4 chunks of 2 layers, blocks of 3 cross chunk ends
    ranges = [(r.start, r.stop) for r in map(layout.layer_range, range(layout.num_chunks))]
    gen = torch.Generator().manual_seed(5)
    mbs = [(t[:, :-1], t[:, 1:]) for t in (torch.randint(0, 257, (2, 9), generator=gen) for _ in range(4))]
    results = {}
    for m in ("none", mode):
        cfg = _cfg(m, True, "model.num_layers=8", "model.attnres.block_size=3")
        local = {c: K3Chunk(cfg, *ranges[c], first=c == 0, last=c == layout.num_chunks - 1)
                 for c in layout.chunks_of_rank(rank)}
        engine = PipelineEngine(local_chunks=local, num_chunks=layout.num_chunks,
                                produced_blocks=produced_blocks(cfg, ranges), pp_group=group)
        loss = engine.train_step(mbs)
        results[m] = (loss, {(c, n): p.grad for c, ch in local.items() for n, p in ch.named_parameters()},
                      engine.deallocated_outputs)
    loss, grads, dealloc = results[mode]
    torch.testing.assert_close(loss, results["none"][0], **EXACT)
    for key, g in results["none"][1].items():
        torch.testing.assert_close(grads[key], g, **EXACT, msg=lambda s: f"rank {rank} {mode} {key}: {s}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_pipeline_p2_v2_matches_none(mode):
    run_multiprocess(_pp_rank, 2, mode)
