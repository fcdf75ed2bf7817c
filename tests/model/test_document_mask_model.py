"""Document masking through the whole model (KDA, MLA, AttnRes, MoE): a packed batch gives
every document what it gets run alone, logits, per-token losses and every weight gradient, in
one chunk (recompute none / selective / full) and through the pipeline engine's chunks.

Reference: each document (a segment of a row, opened by EOD or the row start) as its own
``[1, L]`` batch without boundaries. fp64, rtol = atol = 1e-10. MoE balancing aux_free: routing
is per token (quantile balancing thresholds over the batch, so a batch of other tokens routes
differently: not a masking question).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3train.data.documents import document_cu_seqlens
from k3train.model.model import K3Chunk, build_model, produced_blocks
from pipeline import PipelineEngine
from tests.helpers import tiny_cfg

TIGHT = dict(rtol=1e-10, atol=1e-10)
EOD = 63


def _windows() -> torch.Tensor:
    """[2, 17] windows: row 0 = tail of a document, EOD, a 4-token document, EOD, another;
    row 1 = one document, EOD twice in a row (an empty document), the rest."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randint(0, EOD, (2, 17), generator=gen)
    w[0, [3, 8]] = EOD
    w[1, [6, 7]] = EOD
    return w


def _cfg(*extra):
    return tiny_cfg("model.vocab_size=64", "model.attnres.enabled=true", "model.attnres.block_size=2",
                    "moe.balancing=aux_free", *extra)


def _segments(cu):
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _run(model, inputs, targets, cu):
    """(logits [B, T, V], per-token losses [B, T], grads) of the summed loss."""
    model.zero_grad(set_to_none=True)
    logits = model(inputs, segments=cu)
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    losses.sum().backward()
    return logits.detach(), losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None}


def _alone(model, inputs, targets, cu):
    """Each document through the model alone; logits and losses scattered back, grads summed."""
    B, T = inputs.shape
    flat_in, flat_tg = inputs.flatten(), targets.flatten()
    logits = torch.zeros(B * T, model.head.out_features, dtype=torch.float64)
    losses = torch.zeros(B * T, dtype=torch.float64)
    grads: dict[str, torch.Tensor] = {}
    for lo, hi in _segments(cu):
        lg, ls, g = _run(model, flat_in[lo:hi][None], flat_tg[lo:hi][None], None)
        logits[lo:hi], losses[lo:hi] = lg[0], ls[0]
        for n, t in g.items():
            grads[n] = grads[n] + t if n in grads else t
    return logits.view(B, T, -1), losses.view(B, T), grads


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_packed_documents_equal_documents_alone(world1, recompute):
    model = build_model(_cfg(f"train.recompute={recompute}")).double()
    w = _windows()
    inputs, targets = w[:, :-1], w[:, 1:]
    cu = document_cu_seqlens(inputs, EOD)
    assert cu.tolist() == [0, 3, 8, 16, 22, 23, 32]
    logits, losses, grads = _run(model, inputs, targets, cu)
    ref_logits, ref_losses, ref_grads = _alone(model, inputs, targets, cu)
    torch.testing.assert_close(logits, ref_logits, **TIGHT)
    torch.testing.assert_close(losses, ref_losses, **TIGHT)
    assert grads.keys() == ref_grads.keys() and len(grads) > 20
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **TIGHT, msg=lambda m, n=n: f"{n}: {m}")
    # without the boundaries the later documents see the earlier ones
    unmasked = model(inputs)
    assert (unmasked[0, 3:] - logits[0, 3:]).abs().max() > 1e-6


def test_pipeline_chunks_carry_the_boundaries(world1):
    """P=1, V=2 on one rank: the second chunk gets the boundaries from the engine (StageIO),
    not from the first chunk's output tensors; loss and every gradient equal the one-chunk run."""
    cfg = _cfg("train.microbatches=2")
    whole = build_model(cfg).double()
    ranges = [(0, 2), (2, 4)]
    chunks = [K3Chunk(cfg, lo, hi, first=c == 0, last=c == 1).double() for c, (lo, hi) in enumerate(ranges)]
    engine = PipelineEngine(local_chunks=dict(enumerate(chunks)), num_chunks=2,
                            produced_blocks=produced_blocks(cfg, ranges))
    w = _windows()
    mbs = [(b[:, :-1], b[:, 1:], document_cu_seqlens(b[:, :-1], EOD)) for b in w.chunk(2)]
    loss = engine.train_step(mbs)
    ref = sum(whole(i, t, segments=s) for i, t, s in mbs) / 2
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), **TIGHT)
    ref_grads = dict(whole.named_parameters())
    offset = {0: 0, 1: 2}
    for c, ch in enumerate(chunks):
        for n, p in ch.named_parameters():
            name = n
            if n.startswith("layers."):
                i, rest = n.split(".", 2)[1:]
                name = f"layers.{int(i) + offset[c]}.{rest}"
            torch.testing.assert_close(p.grad, ref_grads[name].grad, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")
