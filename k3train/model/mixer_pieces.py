"""A KDA layer's mixer half in token pieces (``train.recompute_pieces`` under offload).

Under offload each layer is two checkpoint regions, and the backward holds one region's
recomputed activations at a time (``k3train/model/recompute.py``). The FFN half is per token, so
its pieces are independent. The KDA mixer half is not: its short conv reads the ``W - 1`` tokens
before each token, and its recurrence carries a state ``[H, K, V]`` per row from token to token.
So piece ``j`` of ``[s, e)`` runs as one region whose inputs are

* the half's inputs (the partial sum, the blocks) over ``[s - halo, e)``: the depth mix, the
  norm and the projections are per token, so the ``halo = W - 1`` tokens before the piece give
  the conv exactly the inputs the whole window's conv reads (their own outputs are dropped);
* the recurrent state after piece ``j - 1`` (fp32 ``[B, H, K, V]``), an output of that piece's
  region, so its gradient flows back from piece ``j`` to ``j - 1`` like any activation's.

With documents the piece's own boundaries are cut from the window's (``MixerPiece``): the conv's
``[halo, piece]`` rows restart at every document start inside them, and the recurrence gives the
carried state only to the first document of a row when it began before ``s``.

The sum is exact: the same recurrence, cut where the state is handed over (fp64 on CPU within
1e-12 of the whole half, tests/model/test_offload.py). What it saves: the backward holds one
piece's recomputed mixer activations and one piece's KDA backward working set (what fla's
``chunk_kda_bwd`` allocates besides the saved tensors: about 42 KB per token at k3_mini's
widths, read from fla 0.6.0's source, docs/long_context.md) instead of the whole window's.

An MLA layer's mixer half runs as one region over the whole window that makes the compact
latent ``kv_down(x)`` (``[B, T, kv_lora_rank + rope]``, a third of the hidden state's width at
K3), then one region per piece: its queries, gate and output over ``[s, e)`` from the half's
inputs there, and its keys and values expanded from the latent of ``[0, e)`` (an input, a view
of the latent region's output), each query attending the earlier keys of its document (SDPA's
lower-right causal alignment). The backward then holds one piece's query side and the keys and
values of its prefix instead of the whole window's query and key sides.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3train.model.cp_documents import halo_cu_seqlens, rank_document_starts

__all__ = ["MixerPiece", "attention_piece", "carried_state", "initial_state", "mixer_piece", "piece_bounds"]


def piece_bounds(length: int, pieces: int) -> list[tuple[int, int]]:
    """``[s, e)`` of ``pieces`` consecutive pieces of ``length`` tokens, the first ones one token
    longer where it does not divide (the FFN half's split, ``recompute._ffn_in_pieces``)."""
    sizes = [length // pieces + (j < length % pieces) for j in range(pieces)]
    starts = [sum(sizes[:j]) for j in range(pieces)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


@dataclass(frozen=True)
class MixerPiece:
    """What a KDA layer needs to run the tokens ``[start, end)`` of every row of its window.

    halo: the tokens before ``start`` the region also holds (the conv's ``W - 1``, fewer at the
    row start). hand_over: whether the state after the piece is needed (not the last piece).
    Without documents the boundary fields are None. With them: conv_cu, the ``cu_seqlens`` of
    the conv's ``[halo, piece]`` rows (int32); core_cu, those of the piece's rows (int64);
    first / last, per row, the index of its first / last document among core_cu's;
    continues, per row, whether its first document began before ``start`` (bool ``[B]``).
    An attention piece (``attention_piece``) has none of those but spans: per row, the
    ``(key_start, query_start, query_end)`` of each document the piece's queries lie in."""

    start: int
    end: int
    halo: int
    hand_over: bool
    conv_cu: torch.Tensor | None = None
    core_cu: torch.Tensor | None = None
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
    continues: torch.Tensor | None = None
    spans: tuple | None = None


def mixer_piece(start: int, end: int, *, halo: int, hand_over: bool, cu_seqlens: torch.Tensor | list[int] | None,
                batch: int, seq_len: int, device) -> MixerPiece:
    """The piece ``[start, end)`` of rows of ``seq_len`` tokens, with up to ``halo`` tokens before
    it; ``cu_seqlens``: the window's document boundaries ``[N+1]`` over the ``batch * seq_len``
    tokens (``k3train.ops.documents``), as a tensor or already read to the host (the caller of
    several pieces reads them once: a read waits for the device), or None. Made once per forward
    (the recompute reuses the piece)."""
    halo = min(halo, start)
    if cu_seqlens is None:
        return MixerPiece(start, end, halo, hand_over)
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.tolist()
    n = end - start
    conv_starts = rank_document_starts(cu_seqlens, batch, seq_len, start - halo, n + halo)
    core_starts = rank_document_starts(cu_seqlens, batch, seq_len, start, n)
    # Each row begins a sequence of the piece; every document start inside it begins another.
    counts = [1 + sum(1 for p in row if p != 0) for row in core_starts]
    first = [sum(counts[:b]) for b in range(batch)]
    last = [f + c - 1 for f, c in zip(first, counts)]
    continues = [start > 0 and 0 not in row for row in core_starts]
    return MixerPiece(start, end, halo, hand_over,
                      conv_cu=halo_cu_seqlens(conv_starts, n + halo, device),
                      core_cu=halo_cu_seqlens(core_starts, n, device).long(),
                      first=torch.tensor(first, device=device), last=torch.tensor(last, device=device),
                      continues=torch.tensor(continues, device=device))


def initial_state(piece: MixerPiece, carried: torch.Tensor | None) -> torch.Tensor | None:
    """The recurrence's initial state for ``piece`` from the state ``carried`` ``[B, H, K, V]``
    after the piece before (None for the first piece): as is without documents; with them
    ``[N, H, K, V]``, the carried row's state at the row's first document where it continues,
    zeros elsewhere."""
    if carried is None or piece.core_cu is None:
        return carried
    n_docs = piece.core_cu.numel() - 1
    keep = piece.continues.to(carried.dtype).view(-1, *([1] * (carried.dim() - 1)))
    init = carried.new_zeros(n_docs, *carried.shape[1:])
    return init.index_add(0, piece.first, carried * keep)


def carried_state(piece: MixerPiece, final: torch.Tensor) -> torch.Tensor:
    """The state each row hands to the next piece: ``final`` itself without documents
    (``[B, H, K, V]``), the row's last document's state with them (``final`` ``[N, H, K, V]``)."""
    return final if piece.core_cu is None else final.index_select(0, piece.last)


def attention_piece(start: int, end: int, *, cu_seqlens: torch.Tensor | list[int] | None, batch: int,
                    seq_len: int) -> MixerPiece:
    """An MLA layer's piece ``[start, end)``: its queries attend every earlier key of their
    document, so the piece reads the keys ``[0, end)``; with documents (``cu_seqlens`` as in
    ``mixer_piece``), per row the spans ``(a, lo, hi)`` of the documents ``[a, z)`` it meets,
    queries ``[lo, hi) = [a, z) & [start, end)`` attending keys ``[a, hi)`` (row positions)."""
    if cu_seqlens is None:
        return MixerPiece(start, end, 0, False)
    rows: list[list[tuple[int, int, int]]] = [[] for _ in range(batch)]
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    for a, z in zip(bounds[:-1], bounds[1:]):
        b, lo = divmod(a, seq_len)
        hi = lo + (z - a)
        if z > a and hi > start and lo < end:
            rows[b].append((lo, max(lo, start), min(hi, end)))
    return MixerPiece(start, end, 0, False, spans=tuple(tuple(r) for r in rows))
