"""Document boundaries inside packed windows, in the one form every mixer takes: ``cu_seqlens``.

``cu_seqlens`` is a LongTensor ``[N+1]``: the ``B*T`` tokens of a batch ``[B, T]`` flattened row
by row, cut into ``N`` documents; entry ``n`` is where document ``n`` starts, the last entry is
``B*T``. Every row start is a document start (a row never continues the row before it), so a
batch without any boundary inside its rows has ``cu_seqlens = [0, T, 2T, ..., B*T]``. This is
fla's and FlashAttention's varlen convention (fla's kernels take it as is, with the batch
flattened to one row); the CPU paths derive what they need from it here. ``None`` anywhere
means one document per row: no masking, the behaviour without ``data.document_mask``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.config import layout_rules

__all__ = ["conv_chunk_indices", "document_attention", "document_ids", "positions_in_document",
           "same_document_causal_mask"]

# MLA's document masking switches from one dense-mask SDPA call (built on the device, so a
# CUDA graph records it) to a causal call per document (reads the boundaries on the host) at
# this window; the reasons and measurements are with the constant, in the layout rules that
# keep such steps out of CUDA graphs.
PER_DOCUMENT_MIN_WINDOW = layout_rules.PER_DOCUMENT_MIN_WINDOW


def document_ids(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """The index ``n`` of the document each token belongs to -> LongTensor ``[B, T]``."""
    pos = torch.arange(batch * seq_len, device=cu_seqlens.device)
    return (torch.bucketize(pos, cu_seqlens.to(pos.dtype), right=True) - 1).view(batch, seq_len)


def positions_in_document(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """How many tokens of its own document precede each token -> LongTensor ``[B, T]`` (0 at a
    document start)."""
    ids = document_ids(cu_seqlens, batch, seq_len)
    pos = torch.arange(batch * seq_len, device=cu_seqlens.device).view(batch, seq_len)
    return pos - cu_seqlens.to(pos.dtype)[ids]


def same_document_causal_mask(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """Where query ``t`` may attend key ``s``: ``s <= t`` and both in one document -> bool
    ``[B, 1, T, T]`` (SDPA's ``attn_mask``, True = attend; block-diagonal causal)."""
    ids = document_ids(cu_seqlens, batch, seq_len)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=ids.device).tril()
    return ((ids.unsqueeze(-1) == ids.unsqueeze(-2)) & causal).unsqueeze(1)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                       scale: float | None = None) -> torch.Tensor:
    """Causal attention within each document: q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]`` ->
    ``[B, H, T, Dv]``, what SDPA gives with ``same_document_causal_mask`` (to summation order).

    Windows shorter than ``PER_DOCUMENT_MIN_WINDOW``: one SDPA call with the dense mask, built
    on the device (capturable in a CUDA graph). Longer ones: one causal SDPA call per document
    (flash kernels, no ``[T, T]`` mask), which reads the boundaries on the host; zero-length
    documents (the padding of ``k3train.data.documents.document_cu_seqlens_padded``) are skipped."""
    B, _, T, _ = q.shape
    if T < PER_DOCUMENT_MIN_WINDOW:
        mask = same_document_causal_mask(cu_seqlens, B, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    bounds = cu_seqlens.tolist()
    rows: list[list[torch.Tensor]] = [[] for _ in range(B)]
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        b, lo = divmod(start, T)
        hi = lo + (end - start)
        rows[b].append(F.scaled_dot_product_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi],
                                                      v[b:b + 1, :, lo:hi], is_causal=True, scale=scale))
    return torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)


def conv_chunk_indices(cu_seqlens: torch.Tensor, total: int, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's varlen ``causal_conv1d`` chunk list built on the device, in a fixed shape, so a
    CUDA graph can record it (fla builds it on the host). ``cu_seqlens`` ``[N+1]`` over ``total``
    tokens -> ``(cu_ext [N+2], chunk_indices [total // chunk + N, 2])``: ``cu_ext`` appends one
    zero-length document (index ``N``); row ``i`` of ``chunk_indices`` is ``(document, chunk in
    it)`` for the real chunks in order, and every row past them points at chunk 0 of the
    zero-length document, whose program loads and stores no token and contributes zero to the
    weight gradient (fla's kernels mask every access by the document's length). Each document
    adds at most one partial chunk, so ``total // chunk + N`` rows always hold the real ones."""
    cu = cu_seqlens.to(torch.int64)
    n = cu.numel() - 1
    cu_ext = torch.cat([cu, cu[-1:]])
    chunks = (cu[1:] - cu[:-1] + chunk - 1).div(chunk, rounding_mode="floor")
    offsets = F.pad(chunks.cumsum(0), (1, 0))                        # [N+1]
    rows = torch.arange(total // chunk + n, device=cu.device)
    doc = torch.searchsorted(offsets, rows, right=True) - 1
    real = rows < offsets[-1]
    doc = torch.where(real, doc, torch.full_like(doc, n))
    within = torch.where(real, rows - offsets[doc.clamp_max(n - 1)], torch.zeros_like(rows))
    return cu_ext, torch.stack([doc, within], 1)
