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

__all__ = ["document_attention", "document_ids", "positions_in_document", "same_document_causal_mask"]

# Below this mean document length (tokens) and window (tokens), one SDPA call with the dense
# block-diagonal mask is cheaper than a causal call per document: the mask costs B*T*T bytes and
# T*T scores per head, a call per document its launches (about 3 forward and 6 backward kernels,
# so hundreds of short documents per row cost more in launches than the T*T they save). From the
# window up, the dense mask is never used: at 32K it is 1 GiB per row, and SDPA's masked kernel
# scored every pair of it (H200: masked training at 32K ran at 0.57x unmasked, 2026-12-04).
PER_DOCUMENT_MIN_MEAN_LEN = 512
PER_DOCUMENT_MIN_WINDOW = 16384


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

    Long documents (see ``PER_DOCUMENT_MIN_MEAN_LEN``) run one causal SDPA call each: the flash
    kernels, no ``[T, T]`` mask, and only ``sum L_i^2`` scores instead of ``T^2``. That path reads
    the boundaries on the host, as the trainer does for every masked batch (masked steps are never
    captured in CUDA graphs: ``layout_rules.cuda_graph_blockers``)."""
    B, _, T, _ = q.shape
    docs = cu_seqlens.numel() - 1   # the count is the shape: no device read for the dense path
    if T < PER_DOCUMENT_MIN_WINDOW and B * T < PER_DOCUMENT_MIN_MEAN_LEN * docs:
        mask = same_document_causal_mask(cu_seqlens, B, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    bounds = cu_seqlens.tolist()
    rows: list[list[torch.Tensor]] = [[] for _ in range(B)]
    for start, end in zip(bounds[:-1], bounds[1:]):
        b, lo = divmod(start, T)
        hi = lo + (end - start)
        rows[b].append(F.scaled_dot_product_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi],
                                                      v[b:b + 1, :, lo:hi], is_causal=True, scale=scale))
    return torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)
