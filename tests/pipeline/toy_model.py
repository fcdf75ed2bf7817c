"""Tiny AttnRes / standard-residual model split into pipeline chunks, for engine tests.

vocab 32, D 16, T 8, B 2; one linear+tanh sublayer per layer; AttnRes blocks of 2 layers.
Before each sublayer the input is a softmax depth mixture over the completed blocks and the
open block's partial sum: ``h = sum_i softmax_i(w . RMSNorm(v_i)) v_i``. Queries are random
(not zero) so every block gets a distinct, non-trivial gradient.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from pipeline import PipelineLayout, StageIO

VOCAB, D, T, B = 32, 16, 8, 2
BLOCK = 2


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def depth_mix(query, values):
    """values: list of [B, T, D]; query: [D] -> [B, T, D]."""
    v = torch.stack(values)                                   # [N, B, T, D]
    w = torch.softmax((rms(v) * query).sum(-1), dim=0)        # [N, B, T]
    return (w.unsqueeze(-1) * v).sum(0)


class Layer(nn.Module):
    def __init__(self, attnres: bool):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.query = nn.Parameter(torch.randn(D) * 0.5) if attnres else None


class Chunk(nn.Module):
    """Layers ``layer_ids`` of the model; embedding if first, final mix + head + CE if last."""

    def __init__(self, layers, layer_ids, first, last, attnres, embed=None, head=None, final_query=None):
        super().__init__()
        self.layers, self.layer_ids = nn.ModuleList(layers), list(layer_ids)
        self.first, self.last, self.attnres = first, last, attnres
        self.embed, self.head, self.final_query = embed, head, final_query

    def _run(self, hidden, blocks):
        blocks = dict(blocks)
        for layer, l in zip(self.layers, self.layer_ids):
            if not self.attnres:
                hidden = hidden + torch.tanh(layer.lin(hidden))
                continue
            n, i = l // BLOCK + 1, l % BLOCK               # block index, position inside it
            vals = [blocks[j] for j in range(n)] + ([hidden] if i > 0 else [])
            y = torch.tanh(layer.lin(depth_mix(layer.query, vals)))
            hidden = y if i == 0 else hidden + y
            if i == BLOCK - 1:
                blocks[n], hidden = hidden, None
        return hidden, blocks

    def forward(self, x, targets=None):
        if self.first:
            e = self.embed(x)
            hidden, blocks = (None, {0: e}) if self.attnres else (e, {})
        else:
            hidden, blocks = x.hidden, x.blocks
        hidden, blocks = self._run(hidden, blocks)
        if not self.last:
            return StageIO(hidden, blocks)
        if self.attnres:
            vals = [blocks[j] for j in sorted(blocks)] + ([hidden] if hidden is not None else [])
            hidden = depth_mix(self.final_query, vals)
        logits = self.head(rms(hidden))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build_chunks(layout: PipelineLayout, attnres: bool = True, seed: int = 0):
    """Returns (chunks: list[Chunk], produced_blocks: list[list[int]])."""
    torch.manual_seed(seed)
    embed, head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
    final_query = nn.Parameter(torch.randn(D) * 0.5) if attnres else None
    layers = [Layer(attnres) for _ in range(layout.num_layers)]
    C = layout.num_chunks
    chunks, produced = [], []
    for c in range(C):
        ids = list(layout.layer_range(c))
        chunks.append(Chunk([layers[l] for l in ids], ids, c == 0, c == C - 1, attnres,
                            embed if c == 0 else None, head if c == C - 1 else None,
                            final_query if c == C - 1 else None))
        done = [l // BLOCK + 1 for l in ids if l % BLOCK == BLOCK - 1] if attnres else []
        produced.append(([0] if attnres and c == 0 else []) + done)
    return chunks, produced


def make_batch(num_microbatches: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g))
            for _ in range(num_microbatches)]


def reference(chunks, microbatches):
    """Single-process run: chunks in sequence, mean of microbatch losses; returns (loss, grads)."""
    chunks = copy.deepcopy(chunks)
    losses = []
    for x, y in microbatches:
        if len(chunks) == 1:
            losses.append(chunks[0](x, y))
            continue
        io = chunks[0](x)
        for ch in chunks[1:-1]:
            io = ch(io)
        losses.append(chunks[-1](io, y))
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {c: {n: p.grad.clone() for n, p in ch.named_parameters()} for c, ch in enumerate(chunks)}
    return loss.detach(), grads
