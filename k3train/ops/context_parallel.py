"""Context parallelism primitives: the sequence split into contiguous chunks over CP ranks.

Each CP rank of a process group holds tokens ``[r * T, (r + 1) * T)`` of every sequence (``T``
local tokens, ``P`` ranks). What a layer needs from other ranks, and the op that carries it:

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
    "CPCommLog", "all_gather_cp", "causal_attention_cp", "causal_pairs_per_rank", "cp_bytes_per_rank",
    "fold_kda_states", "halo_exchange", "kda_chunks_folded", "kda_cp", "kda_local_states", "mla_attention_cp", "short_conv_cp",
]

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


class _Halo(torch.autograd.Function):
    """This rank's previous rank's last ``width`` tokens (zeros on rank 0); backward sends the
    gradient of the halo back to the rank that owns those tokens."""

    @staticmethod
    def forward(ctx, x, width, group, log, tag):
        rank, size = _rank_size(group)
        ctx.group, ctx.log, ctx.tag, ctx.rank, ctx.size, ctx.width = group, log, tag, rank, size, width
        ctx.shape = x.shape
        tail = x[:, x.shape[1] - width:].contiguous()
        halo = torch.zeros_like(tail)
        reqs = []
        if rank + 1 < size:
            reqs.append(dist.isend(tail, _peer(group, rank + 1), group=group))
            if log is not None:
                log.add(tag, "halo_send", "fwd", _nbytes(tail))
        if rank > 0:
            dist.recv(halo, _peer(group, rank - 1), group=group)
        for r in reqs:
            r.wait()
        return halo

    @staticmethod
    def backward(ctx, grad_halo):
        rank, size, group, width = ctx.rank, ctx.size, ctx.group, ctx.width
        grad_halo = grad_halo.contiguous()
        grad_tail = torch.zeros_like(grad_halo)
        reqs = []
        if rank > 0:
            reqs.append(dist.isend(grad_halo, _peer(group, rank - 1), group=group))
            if ctx.log is not None:
                ctx.log.add(ctx.tag, "halo_send", "bwd", _nbytes(grad_halo))
        if rank + 1 < size:
            dist.recv(grad_tail, _peer(group, rank + 1), group=group)
        for r in reqs:
            r.wait()
        grad_x = grad_halo.new_zeros(ctx.shape)
        grad_x[:, ctx.shape[1] - width:] = grad_tail
        return grad_x, None, None, None, None


def halo_exchange(x: torch.Tensor, width: int, *, group=None, log: CPCommLog | None = None,
                  tag: str = "") -> torch.Tensor:
    """The previous CP rank's last ``width`` tokens of ``x`` ``[B, T, C]`` -> ``[B, width, C]``
    (zeros on the first rank), with autograd (their gradient goes back to that rank)."""
    if width < 0 or width > x.shape[1]:
        raise CPShapeError(f"context parallel: a halo of {width} tokens needs at least that many local "
                           f"tokens per rank, got {x.shape[1]}")
    if width == 0:
        return x[:, :0]
    return _Halo.apply(x, width, group, log, tag)


def short_conv_cp(x: torch.Tensor, weight: torch.Tensor, *, group=None, log: CPCommLog | None = None,
                  conv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = short_conv_silu,
                  doc_start_at_first_token: bool = False) -> torch.Tensor:
    """Causal depthwise short conv + SiLU of this rank's chunk of the sequence.

    x ``[B, T, C]`` (local tokens), weight ``[C, W]`` -> ``[B, T, C]``: equal to the full
    sequence's ``conv`` at these positions. The conv runs over ``[halo, x]`` and the first ``W - 1``
    outputs are dropped (the halo replaces the zero padding). ``doc_start_at_first_token``: a
    document starts at this rank's first token, so the halo (the previous document) is zeroed;
    boundaries further inside the chunk are the varlen conv's business (``cu_seqlens``).
    """
    width = weight.shape[1] - 1
    halo = halo_exchange(x, width, group=group, log=log, tag="conv")
    if doc_start_at_first_token:
        halo = halo * 0
    return conv(torch.cat([halo, x], dim=1), weight)[:, width:]


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


def fold_kda_states(E_all: torch.Tensor, M_all: torch.Tensor, rank: int) -> torch.Tensor:
    """Initial state of ``rank``'s chunk from its predecessors: ``S_0 = 0``,
    ``S_{j+1} = M_j S_j + E_j`` for ``j < rank``. E_all ``[P, B, H, K, V]``, M_all ``[P, B, H, K, K]``
    -> ``[B, H, K, V]`` (fp32 at least: the chain of products must not round to bf16)."""
    S = torch.zeros_like(E_all[0])
    for j in range(rank):
        S = torch.einsum("bhkl,bhlv->bhkv", M_all[j], S) + E_all[j]
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
    """``S_r`` from every rank's ``(E, M)``: one all-gather forward, one all-gather backward.

    Autograd through an all-gather would keep all P ranks' ``(E, M)`` for the fold's backward
    (P x 12.6 MB per layer at K3) and return their gradients with a reduce-scatter. Instead only
    this rank's ``S_r`` and ``M_r`` are kept; backward gathers every rank's ``(G_j, M_j)``, with
    ``G_j = dL/dS_j`` from its own output correction, and folds from the last rank backwards:
    ``D_{P-1} = 0``, ``D_j = G_{j+1} + M_{j+1}^T D_{j+1}`` is ``dL/dS_end`` of chunk j, so
    ``dE_r = D_r`` and ``dM_r = D_r S_r^T``. The same bytes as the reduce-scatter.
    """

    @staticmethod
    def forward(ctx, E, M, group, log):
        rank, size = _rank_size(group)
        sdt = torch.promote_types(E.dtype, torch.float32)
        E_all, M_all = _gather_pairs(E.to(sdt), M.to(sdt), group, log, "fwd")
        S = fold_kda_states(E_all, M_all, rank)
        ctx.save_for_backward(S, M.to(sdt))
        ctx.group, ctx.log, ctx.rank, ctx.size, ctx.dtypes = group, log, rank, size, (E.dtype, M.dtype)
        return S

    @staticmethod
    def backward(ctx, G):
        S, M = ctx.saved_tensors
        G_all, M_all = _gather_pairs(G.to(S.dtype).contiguous(), M, ctx.group, ctx.log, "bwd")
        D = torch.zeros_like(S)
        for j in range(ctx.size - 1, ctx.rank, -1):  # D becomes dL/dS_end of chunk j - 1
            D = G_all[j] + torch.einsum("bhlk,bhlv->bhkv", M_all[j], D)
        dE = D
        dM = torch.einsum("bhkv,bhlv->bhkl", D, S)
        return dE.to(ctx.dtypes[0]), dM.to(ctx.dtypes[1]), None, None


def kda_cp(q, k, v, g, beta, *, group=None, scale: float | None = None, kernel: KdaKernel = kda,
           doc_starts: Sequence[int] = (), log: CPCommLog | None = None) -> torch.Tensor:
    """KDA of this rank's chunk of a sequence split contiguously over the CP ``group``.

    Shapes as ``k3train.ops.kda.kda`` on the local chunk; returns o ``[B, T, H, V]`` in v's dtype,
    equal to the full sequence's KDA output at these positions (forward and backward). Every rank
    of the group must run this op's backward (it is a collective).

    ``doc_starts`` (local positions where documents start, see :func:`kda_local_states`) is the
    document-masking flag: a rank with any start passes on a transition of zero, so its
    predecessors' state does not cross it (a document that ended does not pass state), and a
    start at position 0 also ignores the state it receives.
    """
    o0, q_tilde, E, M = kda_local_states(q, k, v, g, beta, scale=scale, kernel=kernel, doc_starts=doc_starts)
    if doc_starts:
        M = torch.zeros_like(M)  # the flag: nothing before this rank reaches past it
    S = _KdaStateExchange.apply(E, M, group, log)
    return (o0.to(S.dtype) + torch.einsum("bthk,bhkv->bthv", q_tilde.to(S.dtype), S)).to(v.dtype)


def _fold_and_correct(o0, q_tilde, E_all, M_all, rank: int) -> torch.Tensor:
    """``o0 + q~ S_rank`` with ``S_rank`` folded from the predecessors' ``(E, M)``, in the state dtype."""
    S = fold_kda_states(E_all, M_all, rank)
    return o0.to(S.dtype) + torch.einsum("bthk,bhkv->bthv", q_tilde.to(S.dtype), S)


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


def mla_attention_cp(q: torch.Tensor, latent: torch.Tensor,
                     expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], *, group=None,
                     scale: float | None = None, log: CPCommLog | None = None) -> torch.Tensor:
    """MLA's attention core for this rank's chunk, with the latent all-gathered.

    Args:
        q: local queries ``[B, T, H, Dqk]``.
        latent: local ``kv_down`` output ``[B, T, R]`` (``R = kv_lora_rank + shared key dim``), the
            smallest per-token tensor the keys and values are built from.
        expand: the layer's own up-projection, ``[B, S, R] -> (k [B, S, H, Dqk], v [B, S, H, Dv])``.

    Returns ``[B, T, H, Dv]``, equal to the full sequence's causal attention at these positions.
    The gathered latent is cut to the prefix this rank's queries can see before expanding, so
    rank r expands ``(r + 1) T`` tokens; the latent's gradient is reduce-scattered back.
    """
    rank, _ = _rank_size(group)
    T = q.shape[1]
    full = all_gather_cp(latent, group=group, dim=1, log=log, tag="mla")[:, :(rank + 1) * T]
    k, v = expand(full)
    o = causal_attention_cp(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q_offset=rank * T,
                            scale=scale)
    return o.transpose(1, 2)


# --------------------------------------------------------------------------- accounting


def causal_pairs_per_rank(seq_len: int, cp: int, partition: str = "contiguous") -> list[int]:
    """(query, key) pairs of causal attention each rank computes, for ``seq_len`` tokens over
    ``cp`` ranks: attention FLOPs per rank are proportional to these.

    ``contiguous``: rank r holds tokens ``[r n, (r+1) n)``, ``n = seq_len / cp``; ``head_tail``:
    the sequence in ``2 cp`` pieces, rank r holds pieces r and ``2 cp - 1 - r``.
    """
    if partition not in ("contiguous", "head_tail"):
        raise CPShapeError(f"context parallel: partition must be contiguous or head_tail, got {partition!r}")
    pieces = cp if partition == "contiguous" else 2 * cp
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
                      mla_latent_dim: int = 0, state_bytes: int = 4, act_bytes: int = 2) -> dict[str, int]:
    """Bytes ``rank`` sends per layer type, forward and backward, under contiguous CP.

    - ``kda_fwd``/``kda_bwd``: the all-gather of ``[E, M]`` ``[B, H, K, V + K]`` and its
      reduce-scatter, ``(cp - 1) B H K (V + K) state_bytes`` each (independent of the length).
    - ``conv_fwd``: ``B (W - 1) C act_bytes`` to the next rank (0 on the last rank);
      ``conv_bwd``: the same to the previous rank (0 on the first). C: all conv channels of the
      layer (3 H K for KDA's q, k, v convs).
    - ``mla_fwd``/``mla_bwd``: all-gather of the latent ``[B, T, R]`` and its reduce-scatter,
      ``(cp - 1) B T R act_bytes`` each.
    """
    V = kda_head_dim if kda_value_dim is None else kda_value_dim
    fold = (cp - 1) * batch * kda_heads * kda_head_dim * (V + kda_head_dim) * state_bytes
    halo = batch * (conv_width - 1) * conv_channels * act_bytes
    latent = (cp - 1) * batch * local_tokens * mla_latent_dim * act_bytes
    return {
        "kda_fwd": fold, "kda_bwd": fold,
        "conv_fwd": halo if rank + 1 < cp else 0, "conv_bwd": halo if rank > 0 else 0,
        "mla_fwd": latent, "mla_bwd": latent,
    }
