"""Document masking in a CUDA-graphed step: the fixed-shape boundaries a graph records give
what the exact ones give, and a batch they cannot hold runs eagerly.

References: the exact boundaries (``document_cu_seqlens``, the EOD tokens found one by one), a
loop over the documents for fla's conv chunk list, and the model run with the exact boundaries
(fp64, rtol = atol = 1e-12: padding adds only zero-length documents, which every mixer skips).
The recording itself (fla's use_graph kernels, the conv's device-built chunk list) runs on a
GPU: scripts/gpu_check_document_mask.py --graphed.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from k3train.data.documents import (WindowDocuments, document_count, document_cu_seqlens,
                                    document_cu_seqlens_padded, max_documents)
from k3train.model.model import build_model
from k3train.ops.documents import conv_chunk_indices
from k3train.model.model import K3Chunk, produced_blocks
from k3train.trainer.cuda_graph import CapturedDocuments, ChunkForwardState, GraphedForwardBackward
from pipeline import PipelineEngine, PipelineLayout
from pipeline.chunk_graphs import EagerGraph
from tests.helpers import tiny_cfg

EOD = 3
TIGHT = dict(rtol=1e-12, atol=1e-12)


def _windows(B: int, T: int, seed: int, eod_every: float = 0.15) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(4, 60, (B, T + 1), generator=gen)
    w[torch.rand(B, T + 1, generator=gen) < eod_every] = EOD
    return w


def test_padded_boundaries_are_the_exact_ones_then_zero_length_documents():
    inputs = _windows(3, 40, 0)[:, :-1]
    exact = document_cu_seqlens(inputs, EOD)
    n = exact.numel() - 1
    assert n == document_count(inputs, EOD) and n > 6
    for max_docs in (n, n + 1, n + 9):
        padded = document_cu_seqlens_padded(inputs, EOD, max_docs)
        assert padded.shape == (max_docs + 1,) and padded.dtype == torch.int64
        assert padded[:n + 1].tolist() == exact.tolist()
        assert padded[n:].tolist() == [3 * 40] * (max_docs + 1 - n)
    # One slot fewer than documents: the windows' end (B*T) is lost, which fits() exists to catch.
    assert document_cu_seqlens_padded(inputs, EOD, n - 1)[-1].item() != 3 * 40


def test_fits_counts_against_the_fixed_shape():
    T = 128
    docs = WindowDocuments(EOD)
    assert max_documents(2, T) == 2 * (T // 64 + 1)
    few = _windows(2, T, 1, eod_every=0.0)
    few[:, [5, 70]] = EOD                           # three documents per row, 6 in all
    many = _windows(2, T, 2, eod_every=0.5)
    assert docs.fits(few) and not docs.fits(many)
    assert docs(few).tolist() == document_cu_seqlens(few[:, :-1], EOD).tolist()
    assert docs.padded(few).shape == (max_documents(2, T) + 1,)


def _naive_chunks(cu: list[int], chunk: int) -> list[tuple[int, int]]:
    return [(n, i) for n, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])) for i in range(-(-(hi - lo) // chunk))]


@pytest.mark.parametrize("cu", [[0, 64, 128], [0, 5, 70, 71, 200, 256], [0, 1, 2, 3, 256],
                                [0, 100, 256, 256, 256]])
def test_conv_chunk_list_is_the_loop_over_documents_then_a_zero_length_one(cu):
    total, chunk = cu[-1], 64
    cu_ext, rows = conv_chunk_indices(torch.tensor(cu), total, chunk)
    want = _naive_chunks(cu, chunk)
    n = len(cu) - 1
    assert cu_ext.tolist() == cu + [cu[-1]]
    assert rows.shape == (total // chunk + n, 2)
    assert [tuple(r) for r in rows[:len(want)].tolist()] == want
    assert all(tuple(r) == (n, 0) for r in rows[len(want):].tolist())   # document n is empty


def test_model_with_padded_boundaries_equals_the_exact_ones_fp64(world1):
    cfg = tiny_cfg("train.seq_len=24", "train.micro_batch_size=2")
    torch.manual_seed(0)
    model = build_model(cfg).double()
    w = _windows(2, 24, 4, eod_every=0.2)
    x, t = w[:, :-1], w[:, 1:]
    exact = document_cu_seqlens(x, EOD)
    padded = document_cu_seqlens_padded(x, EOD, exact.numel() + 4)   # five zero-length documents
    assert padded[exact.numel():].tolist() == [48] * 5
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for cu in (exact, padded):
        loss = model(x, t, segments=cu)
        out.append((loss.detach(), torch.autograd.grad(loss, params)))
    torch.testing.assert_close(out[0][0], out[1][0], **TIGHT)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, **TIGHT)
    unmasked = model(x, t)
    assert abs(unmasked.item() - out[0][0].item()) > 1e-6   # the boundaries matter here


class _FakeGraph:
    """CPU stand-in for torch.cuda.CUDAGraph: capture runs the step eagerly, replay does nothing."""

    def replay(self):
        pass


def test_captured_step_records_the_padded_form_and_too_many_documents_run_eagerly(monkeypatch):
    capturing = [False]

    @contextlib.contextmanager
    def fake_graph(graph):
        capturing[0] = True
        yield
        capturing[0] = False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    docs = CapturedDocuments(WindowDocuments(EOD), microbatches=2)
    seen = []
    weight = torch.nn.Parameter(torch.ones(()))

    def fwd_bwd(batch):
        for mb in batch.chunk(2):
            seen.append((capturing[0], docs(mb)))
        (weight * 2).backward()
        return torch.zeros(())

    graphed = GraphedForwardBackward(fwd_bwd, [weight], [], warmup=1, accepts=docs.fits)
    T = 128
    few, many = _windows(4, T, 5, eod_every=0.0), _windows(4, T, 6, eod_every=0.5)
    few[:, 10] = EOD                                # two documents per row: 4 per microbatch
    graphed(few)                                    # warm-up: eager, exact
    assert seen[-1][0] is False and seen[-1][1].tolist() == document_cu_seqlens(few[2:, :-1], EOD).tolist()
    graphed(many)                                   # too many documents: eager, exact, no capture
    assert not graphed.captured and graphed.eager_steps == 1
    assert seen[-1][1].tolist() == document_cu_seqlens(many[2:, :-1], EOD).tolist()
    graphed(few)                                    # the capture records the fixed shape
    assert graphed.captured and seen[-1][0] is True
    assert seen[-1][1].shape == (max_documents(2, T) + 1,)
    graphed(many)
    assert graphed.eager_steps == 2



def _two_chunks(cfg):
    """The model of ``cfg`` as two pipeline chunks under one engine in this process (P = 1,
    V = 2; the config layer asks for pp > 1 before vpp > 1, the engine does not)."""
    layout = PipelineLayout(cfg.model.num_layers, 1, 2)
    ranges = [(r.start, r.stop) for r in map(layout.layer_range, range(2))]
    torch.manual_seed(0)
    chunks = {c: K3Chunk(cfg, *ranges[c], first=c == 0, last=c == 1) for c in range(2)}
    engine = PipelineEngine(local_chunks=chunks, num_chunks=2, produced_blocks=produced_blocks(cfg, ranges))
    return chunks, engine


def test_chunk_graphs_replay_fixed_shape_boundaries_like_the_eager_engine_exact_ones(world1):
    """The engine's chunk graphs (``EagerGraph`` stand-ins: the same slots and static inputs as
    CUDA graphs) fed the fixed-shape boundaries, against the eager engine fed the exact ones:
    chunk 0 gets them as its ``segments=`` keyword, chunk 1 inside its StageIO, each copied
    into the slot's static inputs at every replay. Over 4 steps (the capture in step 2, other
    documents in every step) the losses and gradients agree to 1e-12 (fp64; the graphs sum
    the microbatches' gradients in another order)."""
    cfg = tiny_cfg("train.seq_len=128", "model.attnres.enabled=true", "model.attnres.block_size=2")
    ref_chunks, ref = _two_chunks(cfg)
    chunks, engine = _two_chunks(cfg)
    for c in range(2):
        ref_chunks[c].double()
        chunks[c].double().load_state_dict(ref_chunks[c].state_dict())
    graphs = engine.use_graphs(2, warmup=1, graph_factory=EagerGraph,
                               state=ChunkForwardState({c: chunks[c] for c in range(2)}))
    docs = WindowDocuments(EOD)
    for step in range(4):
        windows = [_windows(2, 128, 20 + 2 * step + i, eod_every=0.0) for i in range(2)]
        for i, w in enumerate(windows):           # 3 to 6 documents, at new places every step
            w[0, 30 + 7 * step + i] = EOD
            w[1, 10 + 11 * step:10 + 11 * step + step % 3 + i] = EOD
        assert all(docs.fits(w) and document_count(w[:, :-1], EOD) == 3 + step % 3 + i
                   for i, w in enumerate(windows))
        out = []
        for eng, parts, cu in ((ref, ref_chunks, docs), (engine, chunks, docs.padded)):
            for ch in parts.values():
                ch.zero_grad(set_to_none=True)
                for layer in ch.moe_layers():
                    layer.routing.clear()
            loss = eng.train_step([(w[:, :-1], w[:, 1:], cu(w)) for w in windows])
            out.append((loss, {(c, n): p.grad for c, ch in parts.items() for n, p in ch.named_parameters()
                               if p.grad is not None}))
        torch.testing.assert_close(out[1][0], out[0][0], **TIGHT)
        assert out[1][1].keys() == out[0][1].keys()
        for key, g in out[0][1].items():
            torch.testing.assert_close(out[1][1][key], g, **TIGHT, msg=lambda s: f"step {step} {key}: {s}")
        assert graphs.captured == (graphs.plan.graphs if step >= 1 else 0)
    # The boundaries matter: the last windows without them give another loss.
    unmasked = ref.eval_step([(w[:, :-1], w[:, 1:]) for w in windows])
    assert abs(unmasked.item() - out[0][0].item()) > 1e-6
