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

__all__ = ["document_ids", "positions_in_document", "same_document_causal_mask"]


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
