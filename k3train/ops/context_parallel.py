"""Context parallelism primitives: the sequence split into pieces over CP ranks.

Two partitions (``partition=``, the run's ``parallel.cp_partition``), ``P`` ranks, ``T`` local
tokens per rank:

- ``contiguous``: ``P`` pieces, rank r holds tokens ``[r T, (r + 1) T)``.
- ``head_tail``: ``2 P`` pieces of ``n = T / 2`` tokens, rank r holds pieces r and
  ``2 P - 1 - r`` (in that order: its local tokens are the two pieces concatenated), which gives
  every rank the same number of causal attention pairs (:func:`causal_pairs_per_rank`).

Every op below works piece by piece: a rank's pieces are its "slots" (one or two), each piece's
predecessor is the piece before it in the sequence, wherever it lives (:func:`piece_owner`).
What a layer needs from other ranks, and the op that carries it (said for the contiguous split;
under head-tail the same per piece):

- KDA (:func:`kda_cp`): every rank runs its chunk from a zero state in ONE kernel call of value
  width ``V + K`` (values ``[v, 0]``, initial state ``[0, I]``). By linearity of the recurrence
  in its state, that call yields the local output ``o0``, the chunk's end state ``E`` ``[B, H, K,
  V]``, its transition ``M`` ``[B, H, K, K]`` (``S_end = M S_0 + E``) and the per-token query
  correction ``q~_t = P_t^T (scale q_t)`` (``P_t`` the transition up to token t). One all-gather
  of ``[E, M]`` per layer, a fold over the predecessors gives the true initial state ``S_r``, and
  ``o = o0 + q~ S_r`` corrects the output with one small GEMM. Backward: one all-gather of every
  rank's ``(dL/dS_j, M_j)`` and a fold from the last rank back gives this rank's ``dE``, ``dM``
  (only the rank's own ``S_r``, ``M_r`` are kept between forward and backward).
- Short convolution (:func:`short_conv_cp`): the previous rank's last ``W - 1`` input tokens
  (a point-to-point halo); backward sends their gradient back.
- MLA (:func:`mla_attention_cp`): an all-gather of the compact latent (``kv_lora_rank`` plus the
  shared key, per token) instead of per-head keys and values; each rank expands the gathered
  prefix and attends with its queries at their global positions. Backward: a reduce-scatter of
  the latent's gradient.

Every collective goes through :func:`all_gather_cp` or :func:`halo_exchange`, which log the bytes
this rank sends into an optional :class:`CPCommLog`; :func:`cp_bytes_per_rank` is the formula
those logs are tested against. The kernels are arguments (``kernel=kda``, ``conv=short_conv_silu``)
so the GPU path (fla's ``chunk_kda`` with ``initial_state`` and ``output_final_state``) is this
same code. The model calls them under ``parallel.cp > 1`` (``K3Chunk.use_context_parallel``);
``docs/long_context.md`` says what is wired and what is left.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3train.errors import LayoutError
from k3train.ops.kda import kda
from k3train.ops.short_conv import short_conv_silu

__all__ = [
    "PARTITIONS", "CPCommLog", "all_gather_cp", "causal_attention_cp", "causal_pairs_per_rank", "cp_bytes_per_rank",
    "cp_pieces", "cp_token_index", "fold_kda_states", "halo_exchange", "kda_chunks_folded", "kda_cp",
    "kda_local_states", "global_order", "mla_attention_cp", "num_pieces", "piece_owner", "short_conv_cp",
]

PARTITIONS = ("contiguous", "head_tail")

KdaKernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class CPShapeError(LayoutError):
    """A context-parallel op got a local chunk it cannot serve (too short, mismatched shapes)."""


@dataclass
class CPCommLog:
    """Bytes this rank sends in context-parallel collectives, one record per call.

    ``records``: ``(tag, op, direction, nbytes)``: tag ``"kda"``, ``"conv"``, ``"mla"`` (or the
    caller's), op ``"all_gather"``, ``"reduce_scatter"`` or ``"halo_send"``, direction
    ``"fwd"``/``"bwd"``.
    A collective over P ranks counts ``(P - 1)`` times the per-rank piece: what each rank sends
    in a ring or a direct exchange, and what a link model needs.
    """

    records: list[tuple[str, str, str, int]] = field(default_factory=list)

    def add(self, tag: str, op: str, direction: str, nbytes: int) -> None:
        self.records.append((tag, op, direction, int(nbytes)))

    def total(self, tag: str | None = None, direction: str | None = None) -> int:
        return sum(n for t, _, d, n in self.records
                   if (tag is None or t == tag) and (direction is None or d == direction))


def _rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group, group_rank: int) -> int:
    """The global rank point-to-point ops need for ``group_rank`` of ``group`` (None: the world)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# --------------------------------------------------------------------------- the partition


def _check_partition(partition: str) -> None:
    if partition not in PARTITIONS:
        raise CPShapeError(f"context parallel: partition must be contiguous or head_tail, got {partition!r}")


def num_pieces(size: int, partition: str = "contiguous") -> int:
    """How many equal pieces the sequence is cut into over ``size`` CP ranks: ``P`` or ``2 P``."""
    _check_partition(partition)
    return size if partition == "contiguous" else 2 * size


def cp_pieces(rank: int, size: int, partition: str = "contiguous") -> tuple[int, ...]:
    """The global piece indices CP rank ``rank`` holds, in local order (its slots)."""
    _check_partition(partition)
    return (rank,) if partition == "contiguous" else (rank, 2 * size - 1 - rank)


def piece_owner(piece: int, size: int, partition: str = "contiguous") -> tuple[int, int]:
    """(rank, slot) holding global piece ``piece``: under head-tail piece j lives on rank j
    (slot 0) when ``j < P``, else on rank ``2 P - 1 - j`` (slot 1)."""
    _check_partition(partition)
    if partition == "contiguous" or piece < size:
        return piece, 0
    return 2 * size - 1 - piece, 1


def cp_token_index(seq_len: int, rank: int, size: int, partition: str = "contiguous",
                   device=None) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s local tokens, in local order: int64 ``[seq_len / P]``.
    ``x[:, cp_token_index(...)]`` is the rank's share of a whole window ``x`` ``[B, seq_len, ...]``."""
    pieces = num_pieces(size, partition)
    if seq_len % pieces:
        raise CPShapeError(f"context parallel: seq_len {seq_len} must be divisible by {pieces} for a "
                           f"{partition} partition over {size} ranks")
    n = seq_len // pieces
    return torch.cat([torch.arange(p * n, (p + 1) * n, device=device) for p in cp_pieces(rank, size, partition)])


def _piece_len(T: int, slots: int) -> int:
    if T % slots:
        raise CPShapeError(f"context parallel: {T} local tokens do not split into {slots} equal pieces")
    return T // slots


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``x`` along ``dim`` in rank order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, dim, group, log, tag):
        rank, size = _rank_size(group)
        ctx.dim, ctx.group, ctx.log, ctx.tag, ctx.rank, ctx.size = dim, group, log, tag, rank, size
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        if log is not None:
            log.add(tag, "all_gather", "fwd", (size - 1) * _nbytes(x))
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        # Rank j's piece was read by every rank: its gradient is the sum of theirs, delivered to j.
        pieces = [p.contiguous() for p in grad.chunk(ctx.size, dim=ctx.dim)]
        mine = torch.empty_like(pieces[ctx.rank])
        dist.reduce_scatter(mine, pieces, group=ctx.group)
        if ctx.log is not None:
            ctx.log.add(ctx.tag, "reduce_scatter", "bwd", (ctx.size - 1) * _nbytes(mine))
        return mine, None, None, None, None


def all_gather_cp(x: torch.Tensor, *, group=None, dim: int = 0, log: CPCommLog | None = None,
                  tag: str = "") -> torch.Tensor:
    """All ranks' ``x`` (same shape on every rank) concatenated along ``dim`` in rank order, with
    autograd: the gradient of the result is reduce-scattered back, each rank receiving the sum
    over ranks of the gradient of its own piece. ``[..., n, ...]`` -> ``[..., P * n, ...]``."""
    return _AllGather.apply(x, dim, group, log, tag)


def _run_p2p(ops: list) -> None:
    """Post every send and receive at once and wait: one batch (NCCL groups it), so two ranks
    that send to each other cannot each block on its send before posting its receive."""
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _Halo(torch.autograd.Function):
    """For each of this rank's pieces, the last ``width`` tokens of the piece before it in the
    sequence (zeros for piece 0), ``[B, L, width, C]`` (L slots); backward sends each halo's
    gradient back to the rank that owns those tokens. A predecessor held by this rank itself
    (head-tail: rank P - 1's pieces P - 1 and P) is copied, not sent."""

    @staticmethod
    def forward(ctx, x, width, group, log, tag, partition):
        rank, size = _rank_size(group)
        pieces = cp_pieces(rank, size, partition)
        L, total = len(pieces), num_pieces(size, partition)
        n = _piece_len(x.shape[1], L)
        ctx.group, ctx.log, ctx.tag, ctx.rank, ctx.size, ctx.width = group, log, tag, rank, size, width
        ctx.partition, ctx.shape, ctx.n = partition, x.shape, n
        tails = [x[:, (s + 1) * n - width:(s + 1) * n].contiguous() for s in range(L)]
        halos = [torch.zeros_like(tails[0]) for _ in range(L)]
        ops = []
        for s, p in enumerate(pieces):  # my piece p's tail is the halo of piece p + 1
            if p + 1 < total:
                dst, slot = piece_owner(p + 1, size, partition)
                if dst == rank:
                    halos[slot] = tails[s].clone()
                else:
                    ops.append(dist.P2POp(dist.isend, tails[s], _peer(group, dst), group, p + 1))
                    if log is not None:
                        log.add(tag, "halo_send", "fwd", _nbytes(tails[s]))
        for s, p in enumerate(pieces):
            if p > 0:
                src, _ = piece_owner(p - 1, size, partition)
                if src != rank:
                    ops.append(dist.P2POp(dist.irecv, halos[s], _peer(group, src), group, p))
        _run_p2p(ops)
        return torch.stack(halos, dim=1)

    @staticmethod
    def backward(ctx, grad_halo):
        rank, size, group, width, n = ctx.rank, ctx.size, ctx.group, ctx.width, ctx.n
        pieces = cp_pieces(rank, size, ctx.partition)
        total = num_pieces(size, ctx.partition)
        grads = [grad_halo[:, s].contiguous() for s in range(len(pieces))]
        grad_tails = [torch.zeros_like(grads[0]) for _ in pieces]
        ops = []
        for s, p in enumerate(pieces):  # my halo's gradient belongs to piece p - 1's tail
            if p > 0:
                src, slot = piece_owner(p - 1, size, ctx.partition)
                if src == rank:
                    grad_tails[slot] = grad_tails[slot] + grads[s]
                else:
                    ops.append(dist.P2POp(dist.isend, grads[s], _peer(group, src), group, p))
                    if ctx.log is not None:
                        ctx.log.add(ctx.tag, "halo_send", "bwd", _nbytes(grads[s]))
        received = []
        for s, p in enumerate(pieces):
            if p + 1 < total:
                dst, _ = piece_owner(p + 1, size, ctx.partition)
                if dst != rank:
                    buf = torch.empty_like(grads[0])
                    received.append((s, buf))
                    ops.append(dist.P2POp(dist.irecv, buf, _peer(group, dst), group, p + 1))
        _run_p2p(ops)
        for s, buf in received:
            grad_tails[s] = grad_tails[s] + buf
        grad_x = grad_halo.new_zeros(ctx.shape)
        for s in range(len(pieces)):
            grad_x[:, (s + 1) * n - width:(s + 1) * n] = grad_tails[s]
        return grad_x, None, None, None, None, None


def _halos(x: torch.Tensor, width: int, group, log, tag: str, partition: str) -> torch.Tensor:
    """``[B, L, width, C]``: each local piece's halo (see :class:`_Halo`)."""
    slots = len(cp_pieces(*_rank_size(group), partition))
    n = _piece_len(x.shape[1], slots)
    if width < 0 or width > n:
        raise CPShapeError(f"context parallel: a halo of {width} tokens needs at least that many tokens "
                           f"per piece, got {n}")
    if width == 0:
        return x[:, :0].unsqueeze(1).expand(-1, slots, -1, -1)
    return _Halo.apply(x, width, group, log, tag, partition)


def halo_exchange(x: torch.Tensor, width: int, *, group=None, log: CPCommLog | None = None,
                  tag: str = "") -> torch.Tensor:
    """The previous CP rank's last ``width`` tokens of ``x`` ``[B, T, C]`` -> ``[B, width, C]``
    (zeros on the first rank), with autograd (their gradient goes back to that rank). The
    contiguous split's halo; :func:`short_conv_cp` takes either partition."""
    return _halos(x, width, group, log, tag, "contiguous")[:, 0]


def short_conv_cp(x: torch.Tensor, weight: torch.Tensor, *, group=None, log: CPCommLog | None = None,
                  conv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = short_conv_silu,
                  doc_start_at_first_token: bool | Sequence[bool] = False,
                  partition: str = "contiguous") -> torch.Tensor:
    """Causal depthwise short conv + SiLU of this rank's share of the sequence.

    x ``[B, T, C]`` (local tokens: the rank's L pieces of ``n = T / L`` tokens, concatenated),
    weight ``[C, W]`` -> ``[B, T, C]``: equal to the full sequence's ``conv`` at these positions.
    The conv runs over the rows ``[halo, piece]``, ``[B * L, W - 1 + n, C]`` ordered (row, slot),
    and the first ``W - 1`` outputs of each are dropped (the halo replaces the zero padding); a
    varlen ``conv`` gets ``cu_seqlens`` over those rows. ``doc_start_at_first_token`` (one flag,
    or one per slot): a document starts at the piece's first token, so its halo (the previous
    document) is zeroed; boundaries further inside are the varlen conv's business.
    """
    width = weight.shape[1] - 1
    B, T, C = x.shape
    halo = _halos(x, width, group, log, "conv", partition)
    L = halo.shape[1]
    flags = [doc_start_at_first_token] * L if isinstance(doc_start_at_first_token, bool) else list(doc_start_at_first_token)
    if any(flags):
        keep = torch.tensor([0.0 if f else 1.0 for f in flags], dtype=halo.dtype, device=halo.device)
        halo = halo * keep.view(1, L, 1, 1)
    n = T // L
    rows = torch.cat([halo.reshape(B * L, width, C), x.reshape(B * L, n, C)], dim=1)
    return conv(rows, weight)[:, width:].reshape(B, T, C)


# --------------------------------------------------------------------------- KDA state fold


def kda_local_states(q, k, v, g, beta, *, scale: float | None = None, kernel: KdaKernel = kda,
                     doc_starts: Sequence[int] = ()):
    """KDA over this rank's chunk from a zero state, plus what the fold needs, in one kernel call.

    Args: q, k ``[B, T, H, K]`` (L2-normalised), v ``[B, T, H, V]``, g ``[B, T, H, K]``, beta
    ``[B, T, H]`` as in ``k3train.ops.kda.kda``. ``doc_starts``: local positions where a document
    starts (sorted, in ``[0, T)``); the recurrence restarts from zero there, so only tokens before
    the first start see the carried state (the CPU path runs each segment; the GPU path would pass
    them as ``cu_seqlens`` with the identity seed on the first segment only).

    Returns ``(o0, q_tilde, E, M)``: o0 ``[B, T, H, V]`` the output from a zero initial state;
    q_tilde ``[B, T, H, K]`` with ``o = o0 + q_tilde @ S_0`` for any initial state ``S_0``; E
    ``[B, H, K, V]`` and M ``[B, H, K, K]`` (state dtype) with ``S_end = M @ S_0 + E``.
    The call runs values ``[v, 0]`` from the state ``[0, I]``: each state column evolves on its
    own, so the first V columns are the zero-state run and the last K columns carry the identity,
    whose output is ``P_t^T (scale q_t)`` and whose end state is the chunk's transition.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    sdt = torch.promote_types(v.dtype, torch.float32)
    v_ext = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    seed = torch.cat([q.new_zeros(B, H, K, V, dtype=sdt),
                      torch.eye(K, dtype=sdt, device=q.device).expand(B, H, K, K)], dim=-1)
    if any(not 0 <= s < T for s in doc_starts):
        raise CPShapeError(f"context parallel: doc_starts must lie in [0, {T}), got {list(doc_starts)}")
    bounds = sorted({0, *doc_starts, T})
    outs, state = [], None
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        # Only the segment that continues the previous rank's document carries the identity seed;
        # a segment after a document start begins from zeros, so its q_tilde is 0 and the end
        # state does not depend on what came before (M = 0).
        init = seed if (i == 0 and a not in doc_starts) else torch.zeros_like(seed)
        o, state = kernel(q[:, a:b], k[:, a:b], v_ext[:, a:b], g[:, a:b], beta[:, a:b], scale=scale,
                          initial_state=init, output_final_state=True)
        outs.append(o)
    o = torch.cat(outs, dim=1)
    o0, q_tilde = o.split([V, K], dim=-1)
    E, M = state.split([V, K], dim=-1)
    return o0, q_tilde, E, M


def _fp32_einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """``torch.einsum`` outside autocast: the fold's states and the output correction stay in
    their own (fp32) dtype. Under bf16 autocast einsum would round every operand to bf16, the
    chain of state products included."""
    with torch.autocast(operands[0].device.type, enabled=False):
        return torch.einsum(equation, *operands)


def fold_kda_states(E_all: torch.Tensor, M_all: torch.Tensor, rank: int) -> torch.Tensor:
    """Initial state of ``rank``'s chunk from its predecessors: ``S_0 = 0``,
    ``S_{j+1} = M_j S_j + E_j`` for ``j < rank``. E_all ``[P, B, H, K, V]``, M_all ``[P, B, H, K, K]``
    -> ``[B, H, K, V]`` (fp32 at least: the chain of products must not round to bf16)."""
    S = torch.zeros_like(E_all[0])
    for j in range(rank):
        S = _fp32_einsum("bhkl,bhlv->bhkv", M_all[j], S) + E_all[j]
    return S


def _gather_pairs(a: torch.Tensor, b: torch.Tensor, group, log, direction: str):
    """All ranks' ``a`` ``[B, H, K, V]`` and ``b`` ``[B, H, K, K]`` as ``[P, ...]`` each, one all-gather."""
    _, size = _rank_size(group)
    ab = torch.cat([a, b], dim=-1).contiguous()
    parts = [torch.empty_like(ab) for _ in range(size)]
    dist.all_gather(parts, ab, group=group)
    if log is not None:
        log.add("kda", "all_gather", direction, (size - 1) * _nbytes(ab))
    return torch.stack(parts).split([a.shape[-1], b.shape[-1]], dim=-1)


class _KdaStateExchange(torch.autograd.Function):
    """Each local piece's initial state from every piece's ``(E, M)``: one all-gather forward, one
    all-gather backward.

    E ``[L, B, H, K, V]``, M ``[L, B, H, K, K]`` (this rank's L pieces) -> S ``[L, B, H, K, V]``.
    The gathered pieces are put in sequence order (:func:`piece_owner`) and folded,
    ``S_0 = 0, S_{j+1} = M_j S_j + E_j``; piece p's initial state is ``S_p``.

    Autograd through an all-gather would keep every piece's ``(E, M)`` for the fold's backward
    (P x 12.6 MB per layer at K3) and return their gradients with a reduce-scatter. Instead only
    this rank's ``S`` and ``M`` are kept; backward gathers every piece's ``(G_j, M_j)``, with
    ``G_j = dL/dS_j`` from its own output correction, and folds from the last piece backwards:
    ``D_{last} = 0``, ``D_j = G_{j+1} + M_{j+1}^T D_{j+1}`` is ``dL/dS_end`` of piece j, so
    ``dE_p = D_p`` and ``dM_p = D_p S_p^T``. The same bytes as the reduce-scatter.
    """

    @staticmethod
    def forward(ctx, E, M, group, log, partition):
        rank, size = _rank_size(group)
        sdt = torch.promote_types(E.dtype, torch.float32)
        E_all, M_all = _gather_pairs(E.to(sdt), M.to(sdt), group, log, "fwd")  # [P, L, ...]
        pieces = cp_pieces(rank, size, partition)
        owners = [piece_owner(j, size, partition) for j in range(max(pieces))]
        states = [torch.zeros_like(E_all[0, 0])]
        for r, s in owners:
            states.append(_fp32_einsum("bhkl,bhlv->bhkv", M_all[r, s], states[-1]) + E_all[r, s])
        S = torch.stack([states[p] for p in pieces])
        ctx.save_for_backward(S, M.to(sdt))
        ctx.group, ctx.log, ctx.rank, ctx.size, ctx.dtypes = group, log, rank, size, (E.dtype, M.dtype)
        ctx.partition = partition
        return S

    @staticmethod
    def backward(ctx, G):
        S, M = ctx.saved_tensors
        G_all, M_all = _gather_pairs(G.to(S.dtype).contiguous(), M, ctx.group, ctx.log, "bwd")
        pieces = cp_pieces(ctx.rank, ctx.size, ctx.partition)
        total = num_pieces(ctx.size, ctx.partition)
        D = {total - 1: torch.zeros_like(S[0])}
        for j in range(total - 1, min(pieces), -1):  # D[j - 1]: dL/dS_end of piece j - 1
            r, s = piece_owner(j, ctx.size, ctx.partition)
            D[j - 1] = G_all[r, s] + _fp32_einsum("bhlk,bhlv->bhkv", M_all[r, s], D[j])
        dE = torch.stack([D[p] for p in pieces])
        dM = _fp32_einsum("nbhkv,nbhlv->nbhkl", dE, S)
        return dE.to(ctx.dtypes[0]), dM.to(ctx.dtypes[1]), None, None, None


def kda_cp(q, k, v, g, beta, *, group=None, scale: float | None = None, kernel: KdaKernel = kda,
           doc_starts: Sequence[int] = (), log: CPCommLog | None = None,
           partition: str = "contiguous") -> torch.Tensor:
    """KDA of this rank's share of a sequence split over the CP ``group`` by ``partition``.

    Shapes as ``k3train.ops.kda.kda`` on the local tokens (the rank's L pieces of ``n = T / L``
    tokens, concatenated); returns o ``[B, T, H, V]`` in v's dtype, equal to the full sequence's
    KDA output at these positions (forward and backward). Each piece runs from a zero state (the
    L pieces as a batch of ``L B`` rows in one kernel call when no document starts in them), the
    L ``[E, M]`` are all-gathered and each piece folds its predecessors. Every rank of the group
    must run this op's backward (it is a collective).

    ``doc_starts`` (local positions in ``[0, T)`` where documents start, see
    :func:`kda_local_states`) is the document-masking flag: a piece with any start passes on a
    transition of zero, so the state before it does not cross it (a document that ended does not
    pass state), and a start at a piece's first token also ignores the state it receives.
    """
    rank, size = _rank_size(group)
    L = len(cp_pieces(rank, size, partition))
    B, T = q.shape[:2]
    n = _piece_len(T, L)
    if any(not 0 <= s < T for s in doc_starts):
        raise CPShapeError(f"context parallel: doc_starts must lie in [0, {T}), got {list(doc_starts)}")
    starts = [[s - i * n for s in doc_starts if i * n <= s < (i + 1) * n] for i in range(L)]
    xs = (q, k, v, g, beta)
    if not doc_starts:  # one call over the pieces as rows (slot-major: [L * B, n, ...])
        o0, q_tilde, E, M = kda_local_states(*(torch.cat(x.split(n, dim=1), dim=0) for x in xs),
                                             scale=scale, kernel=kernel)
        o0, q_tilde = (t.view(L, B, *t.shape[1:]) for t in (o0, q_tilde))
        E, M = (t.view(L, B, *t.shape[1:]) for t in (E, M))
    else:
        parts = [kda_local_states(*(x[:, i * n:(i + 1) * n] for x in xs), scale=scale, kernel=kernel,
                                  doc_starts=starts[i]) for i in range(L)]
        o0, q_tilde, E, M = (torch.stack(t) for t in zip(*parts))
        # the flag: nothing before a piece with a start reaches past it
        M = torch.stack([torch.zeros_like(M[i]) if starts[i] else M[i] for i in range(L)])
    S = _KdaStateExchange.apply(E, M, group, log, partition)  # [L, B, H, K, V]
    o = o0.to(S.dtype) + _fp32_einsum("lbthk,lbhkv->lbthv", q_tilde.to(S.dtype), S)
    return torch.cat(o.unbind(0), dim=1).to(v.dtype)


def _fold_and_correct(o0, q_tilde, E_all, M_all, rank: int) -> torch.Tensor:
    """``o0 + q~ S_rank`` with ``S_rank`` folded from the predecessors' ``(E, M)``, in the state dtype."""
    S = fold_kda_states(E_all, M_all, rank)
    return o0.to(S.dtype) + _fp32_einsum("bthk,bhkv->bthv", q_tilde.to(S.dtype), S)


def kda_chunks_folded(q, k, v, g, beta, *, num_chunks: int, scale: float | None = None,
                      kernel: KdaKernel = kda) -> torch.Tensor:
    """The CP fold on one device: the sequence cut into ``num_chunks`` equal chunks, each run by
    :func:`kda_local_states`, their ``(E, M)`` stacked where ranks would all-gather them, and each
    chunk folded and corrected as rank ``r`` does. Shapes as ``k3train.ops.kda.kda``; returns o
    ``[B, T, H, V]`` in v's dtype, equal to the whole sequence's KDA. For checking the fold with
    a GPU kernel on one device (``scripts/gpu_check_kda_cp.py``)."""
    T = q.shape[1]
    if num_chunks < 1 or T % num_chunks:
        raise CPShapeError(f"context parallel: {T} tokens do not split into {num_chunks} equal chunks")
    n = T // num_chunks
    parts = [kda_local_states(*(x[:, i * n:(i + 1) * n] for x in (q, k, v, g, beta)), scale=scale,
                              kernel=kernel) for i in range(num_chunks)]
    E_all = torch.stack([p[2] for p in parts])
    M_all = torch.stack([p[3] for p in parts])
    return torch.cat([_fold_and_correct(p[0], p[1], E_all, M_all, r) for r, p in enumerate(parts)],
                     dim=1).to(v.dtype)


# --------------------------------------------------------------------------- MLA


def causal_attention_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int,
                        scale: float | None = None) -> torch.Tensor:
    """Causal attention of queries at global positions ``q_offset + i`` against keys at global
    positions ``0..S-1``. q ``[B, H, Tq, D]``, k ``[B, H, S, D]``, v ``[B, H, S, Dv]`` ->
    ``[B, H, Tq, Dv]``; keys past the last query are masked (pass only the prefix ``S <= q_offset +
    Tq`` to skip them)."""
    Tq, S = q.shape[-2], k.shape[-2]
    qpos = torch.arange(Tq, device=q.device)[:, None] + q_offset
    allowed = torch.arange(S, device=q.device)[None, :] <= qpos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


def global_order(local: torch.Tensor, size: int, partition: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """Every rank's local tokens gathered in rank order (``[..., P T, ...]`` along ``dim``) put
    back in sequence order: the identity for ``contiguous``, an index along ``dim`` for head-tail."""
    if partition == "contiguous":
        return local
    N = local.shape[dim]
    where = torch.cat([cp_token_index(N, r, size, partition, device=local.device) for r in range(size)])
    return local.index_select(dim, torch.argsort(where))


def mla_attention_cp(q: torch.Tensor, latent: torch.Tensor,
                     expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], *, group=None,
                     scale: float | None = None, log: CPCommLog | None = None,
                     partition: str = "contiguous") -> torch.Tensor:
    """MLA's attention core for this rank's share of the sequence, with the latent all-gathered.

    Args:
        q: local queries ``[B, T, H, Dqk]`` (the rank's L pieces of ``n = T / L`` tokens).
        latent: local ``kv_down`` output ``[B, T, R]`` (``R = kv_lora_rank + shared key dim``), the
            smallest per-token tensor the keys and values are built from.
        expand: the layer's own up-projection, ``[B, S, R] -> (k [B, S, H, Dqk], v [B, S, H, Dv])``.

    Returns ``[B, T, H, Dv]``, equal to the full sequence's causal attention at these positions.
    The gathered latent is put in sequence order and cut to the prefix this rank's last piece
    can see before expanding (``(r + 1) T`` tokens on rank r when contiguous, ``(2 P - r) n``
    under head-tail); each piece p then attends its prefix ``[0, (p + 1) n)`` causally at offset
    ``p n``. The latent's gradient is reduce-scattered back.
    """
    rank, size = _rank_size(group)
    pieces = cp_pieces(rank, size, partition)
    n = _piece_len(q.shape[1], len(pieces))
    gathered = all_gather_cp(latent, group=group, dim=1, log=log, tag="mla")
    k, v = expand(global_order(gathered, size, partition)[:, :(max(pieces) + 1) * n])
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    outs = [causal_attention_cp(q[:, s * n:(s + 1) * n].transpose(1, 2), k[:, :, :(p + 1) * n],
                                v[:, :, :(p + 1) * n], q_offset=p * n, scale=scale)
            for s, p in enumerate(pieces)]
    return torch.cat(outs, dim=2).transpose(1, 2)


# --------------------------------------------------------------------------- accounting


def causal_pairs_per_rank(seq_len: int, cp: int, partition: str = "contiguous") -> list[int]:
    """(query, key) pairs of causal attention each rank computes, for ``seq_len`` tokens over
    ``cp`` ranks: attention FLOPs per rank are proportional to these.

    ``contiguous``: rank r holds tokens ``[r n, (r+1) n)``, ``n = seq_len / cp``; ``head_tail``:
    the sequence in ``2 cp`` pieces, rank r holds pieces r and ``2 cp - 1 - r``.
    """
    pieces = num_pieces(cp, partition)
    if seq_len % pieces:
        raise CPShapeError(f"context parallel: seq_len {seq_len} must be divisible by {pieces} for a "
                           f"{partition} partition over {cp} ranks")
    n = seq_len // pieces

    def pairs(piece: int) -> int:  # queries piece*n .. piece*n+n-1 each see position+1 keys
        a = piece * n
        return n * a + n * (n + 1) // 2

    if partition == "contiguous":
        return [pairs(r) for r in range(cp)]
    return [pairs(r) + pairs(2 * cp - 1 - r) for r in range(cp)]


def cp_bytes_per_rank(*, cp: int, rank: int, batch: int, local_tokens: int, kda_heads: int, kda_head_dim: int,
                      kda_value_dim: int | None = None, conv_channels: int = 0, conv_width: int = 4,
                      mla_latent_dim: int = 0, state_bytes: int = 4, act_bytes: int = 2,
                      partition: str = "contiguous") -> dict[str, int]:
    """Bytes ``rank`` sends per layer type, forward and backward. ``local_tokens``: the rank's
    ``T = N / cp`` tokens under either partition; ``L`` below: its pieces (1, or 2 under head-tail).

    - ``kda_fwd``/``kda_bwd``: the all-gather of the rank's L ``[E, M]`` ``[B, H, K, V + K]``
      and its backward, ``(cp - 1) L B H K (V + K) state_bytes`` each (independent of the length).
    - ``conv_fwd``: ``B (W - 1) C act_bytes`` per halo sent to another rank; ``conv_bwd``: the
      same per halo gradient sent back. Contiguous: forward to the next rank (0 on the last),
      backward to the previous (0 on the first). Head-tail: piece r's tail goes to rank r + 1 and
      piece ``2 P - 1 - r``'s to rank r - 1, both ways, except what stays on rank P - 1 (its
      pieces P - 1 and P are neighbours). C: all conv channels of the layer (3 H K for KDA's
      q, k, v convs).
    - ``mla_fwd``/``mla_bwd``: all-gather of the latent ``[B, T, R]`` and its reduce-scatter,
      ``(cp - 1) B T R act_bytes`` each.
    """
    slots = len(cp_pieces(rank, cp, partition))
    V = kda_head_dim if kda_value_dim is None else kda_value_dim
    fold = (cp - 1) * slots * batch * kda_heads * kda_head_dim * (V + kda_head_dim) * state_bytes
    halo = batch * (conv_width - 1) * conv_channels * act_bytes
    latent = (cp - 1) * batch * local_tokens * mla_latent_dim * act_bytes
    if partition == "contiguous":
        conv_fwd, conv_bwd = (halo if rank + 1 < cp else 0), (halo if rank > 0 else 0)
    else:
        conv_fwd = conv_bwd = halo * ((rank + 1 < cp) + (rank > 0))
    return {
        "kda_fwd": fold, "kda_bwd": fold, "conv_fwd": conv_fwd, "conv_bwd": conv_bwd,
        "mla_fwd": latent, "mla_bwd": latent,
    }
