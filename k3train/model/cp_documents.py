"""Document boundaries under context parallelism: what one CP rank needs from its windows'.

Under ``parallel.cp > 1`` the mixers receive the **whole window's** ``cu_seqlens`` (``[N+1]``
over the flattened ``B * T`` tokens of the full windows, ``T = cp * t`` with ``t`` local tokens,
a boundary at every row start; ``k3train.ops.documents``) and hold the global positions of their
pieces (``[r t, (r+1) t)`` of each row when contiguous; pieces r and ``2 cp - 1 - r`` of ``t / 2``
tokens under head-tail, ``k3train.ops.context_parallel.cp_pieces``). From it: the local document
starts of each row (KDA's ``doc_starts``), the boundaries of the conv's ``[halo, piece]`` rows,
and the document id of every global position (MLA's mask). Boundaries are read on the host, as
document masking does.
"""
from __future__ import annotations

import torch

from k3train.ops.documents import document_ids

__all__ = ["halo_cu_seqlens", "pieces_document_starts", "rank_document_starts", "same_document_causal_mask_at",
           "same_document_causal_mask_cp"]


def rank_document_starts(cu_seqlens: torch.Tensor | list[int], batch: int, seq_len: int, start: int,
                         length: int) -> list[list[int]]:
    """Per row, the local positions in ``[0, length)`` where a document starts, for a rank
    holding positions ``[start, start + length)`` of every row of ``seq_len`` tokens (``start``
    may be negative: positions before a row's first token hold no start). ``cu_seqlens``: the
    tensor, or its values already read to the host (a caller asking for several ranges reads
    them once)."""
    rows: list[list[int]] = [[] for _ in range(batch)]
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    for b in bounds[:-1]:
        row, pos = divmod(int(b), seq_len)
        if start <= pos < start + length:
            rows[row].append(pos - start)
    return rows


def pieces_document_starts(cu_seqlens: torch.Tensor, batch: int, seq_len: int, pieces, n: int,
                           before: int = 0) -> list[list[int]]:
    """Per row ``(b, slot)`` in that order (``b`` major), the positions in ``[0, before + n)``
    where a document starts, for pieces of ``n`` tokens at global offsets ``p n`` extended by the
    ``before`` tokens preceding each (the conv's halo); ``rank_document_starts`` per piece."""
    per_piece = [rank_document_starts(cu_seqlens, batch, seq_len, p * n - before, n + before) for p in pieces]
    return [per_piece[s][b] for b in range(batch) for s in range(len(pieces))]


def halo_cu_seqlens(starts: list[list[int]], row: int, device) -> torch.Tensor:
    """``cu_seqlens`` over the conv's rows ``[halo, chunk]`` of ``row`` tokens each, flattened:
    each row begins a sequence, and so does every document start ``s`` of ``starts`` (per row,
    positions in the extended row: ``rank_document_starts`` from ``start - width``, so a
    document that starts inside the halo, or at the chunk's first token, cuts the tokens before
    it off). -> int32 ``[N+1]``."""
    bounds = {b * row for b in range(len(starts) + 1)}
    bounds |= {b * row + s for b, ss in enumerate(starts) for s in ss}
    return torch.tensor(sorted(bounds), dtype=torch.int32, device=device)


def same_document_causal_mask_at(cu_seqlens: torch.Tensor, batch: int, seq_len: int, positions: torch.Tensor,
                                 keys: int) -> torch.Tensor:
    """Where this rank's query at global position ``positions[i]`` (int64 ``[Tq]``) may attend key
    ``s`` of the prefix ``[0, keys)`` in sequence order: ``s <= positions[i]`` and one document ->
    bool ``[B, 1, Tq, keys]`` (SDPA's ``attn_mask``, True = attend)."""
    ids = document_ids(cu_seqlens, batch, seq_len)
    positions = positions.to(ids.device)
    causal = torch.arange(keys, device=ids.device)[None, :] <= positions[:, None]
    same = ids[:, positions, None] == ids[:, None, :keys]
    return (same & causal).unsqueeze(1)


def same_document_causal_mask_cp(cu_seqlens: torch.Tensor, batch: int, seq_len: int, start: int,
                                 length: int) -> torch.Tensor:
    """Where this rank's query at global position ``start + i`` may attend key ``s`` of the
    gathered prefix ``[0, start + length)``: ``s <= start + i`` and one document -> bool
    ``[B, 1, length, start + length]`` (SDPA's ``attn_mask``, True = attend)."""
    positions = torch.arange(start, start + length, device=cu_seqlens.device)
    return same_document_causal_mask_at(cu_seqlens, batch, seq_len, positions, start + length)
