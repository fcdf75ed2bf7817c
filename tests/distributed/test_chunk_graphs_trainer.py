"""The trainer's pipeline with chunk graphs (``ChunkForwardState`` + the engine's slot graphs)
against the eager pipeline, on two gloo ranks, PP=2 x V=2, a tiny K3 with MoE and AttnRes.

The graphs are ``EagerGraph`` stand-ins (pipeline/chunk_graphs.py): the same slots, static
buffers and forward-state hooks as on a GPU. What this adds to tests/pipeline/test_chunk_graphs.py
is the forward state: the balancer updates the router biases from every microbatch's routing
record after each step, so a record lost, doubled or aliased by a replay changes the biases
and every later loss; and document masking, whose boundaries the graphs take as static inputs
in a fixed shape. Over 5 steps (the capture at step 3) losses, gradient norms, router
biases and the parameters after each update equal the eager run's to 1e-6 (fp32; the graphed
path sums parameter gradients in another order).
"""
from __future__ import annotations

import pytest
import torch

from k3train.config import load_config
from k3train.runtime.distributed import init_distributed
from k3train.data.documents import WindowDocuments
from k3train.trainer.cuda_graph import PaddedDocuments
from k3train.trainer.state import TrainState
from pipeline.chunk_graphs import EagerGraph
from tests.multiproc import run_multiprocess

TOL = dict(rtol=1e-6, atol=1e-6)
TINY = ["model.hidden_size=32", "model.num_layers=4", "model.kda.num_heads=2", "model.kda.head_dim=8",
        "model.mla.num_heads=2", "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16",
        "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8",
        "model.ffn.intermediate_size=32", "moe.num_experts=4", "moe.latent_size=16",
        "moe.expert_ffn_size=16", "moe.shared_ffn_size=16", "model.layer_pattern=KM", "model.dense_layers=1",
        "model.attnres.enabled=true", "model.attnres.block_size=2", "model.tie_embeddings=false",
        "train.seq_len=8", "train.micro_batch_size=2", "train.microbatches=4", "moe.balancing=quantile",
        "parallel.pp=2", "parallel.vpp=2", "train.cuda_graph=false", "train.steps=5",
        "data.document_mask=false"]


EOD = 3


def _masked_batch(step: int, g: torch.Generator, vocab: int, T: int) -> torch.Tensor:
    """8 windows [8, T+1] with documents at new places every step; step 4 has more documents
    per microbatch than the fixed shape holds (``max_documents(2, T)``), so it runs eagerly."""
    batch = torch.randint(EOD + 1, vocab, (8, T + 1), generator=g)
    batch[::2, 5 + step] = EOD
    if step == 4:
        batch[:, 1:T:3] = EOD
    return batch


def _run(graphed: bool, extra: tuple = (), masked: bool = False) -> list:
    cfg = load_config(None, [*TINY, *extra])
    p = cfg.parallel
    info = init_distributed(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep)
    torch.manual_seed(0)
    state = TrainState(cfg, info, torch.device("cpu"), documents=WindowDocuments(EOD) if masked else None)
    if graphed:
        state.use_chunk_graphs(EagerGraph, warmup=2)
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(1, 6):
        batch = (_masked_batch(step, g, cfg.model.vocab_size, cfg.train.seq_len) if masked else
                 torch.randint(0, cfg.model.vocab_size, (8, cfg.train.seq_len + 1), generator=g))
        if masked:
            assert state.documents(batch).numel() > 3   # documents inside the rows
            assert isinstance(state.documents, PaddedDocuments) == graphed
            assert not graphed or state.documents.fits(batch) == (step != 4)
        state.schedule_lr(step)
        stats = state.train_step(batch)
        biases = [layer.router.bias.clone() for layer in state.moe_layers]
        params = [q.detach().clone() for q in state.params]
        out.append((stats["loss"], stats["grad_norm"], biases, params))
    if graphed:
        assert state.engine.graphs.captured == state.engine.graphs.plan.graphs > 0
        # Steps 1-2 warm up, 3 captures, 4 has too many documents (eager), 5 replays.
        assert state.engine.graphs.steps == (4 if masked else 5)
    return out


def _job(rank, world_size, extra=(), masked=False):
    eager, graphed = _run(False, extra, masked), _run(True, extra, masked)
    for step, (e, g) in enumerate(zip(eager, graphed), start=1):
        assert g[0] == pytest.approx(e[0], rel=1e-6, abs=1e-6), (rank, step, "loss")
        assert g[1] == pytest.approx(e[1], rel=1e-5, abs=1e-6), (rank, step, "grad norm")
        for a, b in zip(g[2], e[2]):
            torch.testing.assert_close(a, b, **TOL, msg=lambda s: f"rank {rank} step {step} bias: {s}")
        for a, b in zip(g[3], e[3]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda s: f"rank {rank} step {step} param: {s}")


@pytest.mark.slow
def test_graphed_pipeline_trainer_matches_eager():
    run_multiprocess(_job, 2)


@pytest.mark.slow
def test_graphed_pipeline_with_zero1_and_data_parallel_matches_eager():
    """PP=2 x V=2 x DP=2 with ZeRO-1 and Muon once per matrix: the optimizer (sharded state, the
    owners' Newton-Schulz, the all-gathers) runs after the replay, on the gradients the backward
    graphs summed, so the graphed run steps as the eager one does (issue 40, item 2)."""
    run_multiprocess(_job, 4, ("optim.name=muon", "optim.zero1=true", "optim.muon_distributed=true"))


@pytest.mark.slow
def test_graphed_pipeline_with_document_masking_matches_eager():
    """Document masking under the chunk graphs: the graphed run feeds every microbatch's
    boundaries in the fixed shape (``PaddedDocuments``, 64-token windows: up to 4 documents per
    microbatch of 2), the eager run the exact ones; step 4's microbatches hold more documents
    than that, so it runs without the graphs, with the exact boundaries, and step 5 replays
    again."""
    run_multiprocess(_job, 2, ("train.seq_len=64",), True)
