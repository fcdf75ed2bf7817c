"""Chunked KDA in pure torch (WY / UT-transform form), differentiable by autograd.

Within a chunk of ``C`` tokens, with ``G_r = sum_{s<=r} g_s`` the in-chunk cumulative log-decay
and ``S_0`` the state entering the chunk, the recurrence unrolls to::

    S_r = exp(G_r) * S_0 + sum_{i<=r} (exp(G_r - G_i) * k_i) delta_i^T
    delta_r = beta_r (v_r - (D_r S_{r-1})^T k_r)

Stacking the ``delta_r`` gives a unit lower-triangular system (the UT transform)::

    (I + diag(beta) A_kk) delta = diag(beta) (v - (exp(G) * k) S_0),
    A_kk[r, i] = k_r^T (exp(G_r - G_i) * k_i)   for i < r

so ``delta = U - W S_0`` with ``U, W`` independent of ``S_0``: every chunk is solved at once, and
only the cheap ``S_0`` dependence is carried across chunks in a Python loop.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Sub-chunk length for the intra-chunk decay scores (see _intra_chunk_scores). The pairwise
# diagonal blocks cost C*sub*K and the factorised off-diagonal ones C*(C/sub)*K elements, so
# sub ~ sqrt(C) balances them (8 for the default C = 64).
_SUB = 8


def _intra_chunk_scores(qs: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int):
    """Decay-weighted scores inside each chunk.

    Args:
        qs: scaled queries ``[..., C, K]``.
        k: keys ``[..., C, K]``.
        G: in-chunk cumulative log-decay ``[..., C, K]`` (non-increasing along ``C``).
        sub: sub-chunk length, dividing ``C``.

    Returns:
        ``(A_qk, A_kk)``, each ``[..., C, C]``:
        ``A_qk[r, i] = sum_d qs_r[d] k_i[d] exp(G_r[d] - G_i[d])`` for ``i <= r``, and
        ``A_kk`` the same with ``k`` for ``qs`` and ``i < r``; zero elsewhere.
    """
    C = k.shape[-2]
    n = C // sub
    Gb = G.unflatten(-2, (n, sub))  # [..., n, sub, K]
    Ge = Gb[..., -1, :]  # [..., n, K]: log-decay at the end of each sub-chunk
    # Across sub-chunks, exp(G_r - G_i) = exp(G_r - Ge_j) * exp(Ge_j - G_i) with i in sub-chunk j
    # and r after it: both exponents are <= 0, so this factorisation into a matmul never forms
    # exp(+large). A single chunk-wide reference would overflow fp32 once G spans ~ -90.
    right = k.unflatten(-2, (n, sub)) * (Ge.unsqueeze(-2) - Gb).exp()  # [..., n, sub, K]
    # Given g <= 0, the clamp only touches (r, j) pairs with r inside or before sub-chunk j,
    # which are masked out below.
    left = (G.unsqueeze(-3) - Ge.unsqueeze(-2)).clamp(max=0).exp()  # [..., n, C, K]
    right_t = right.transpose(-1, -2)

    def off_blocks(a: torch.Tensor) -> torch.Tensor:
        scores = (a.unsqueeze(-3) * left) @ right_t  # [..., n, C, sub]
        return scores.movedim(-3, -2).flatten(-2)  # [..., C, C]

    # Within a sub-chunk the pairwise [sub, sub, K] decay is small enough to form directly.
    diff = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).clamp(max=0)  # [..., n, sub(r), sub(i), K]
    Ek = diff.exp() * k.unflatten(-2, (n, sub)).unsqueeze(-3)  # shared by the q and k scores
    eye_n = torch.eye(n, dtype=k.dtype, device=k.device)

    def diag_blocks(a: torch.Tensor) -> torch.Tensor:
        scores = (Ek @ a.unflatten(-2, (n, sub)).unsqueeze(-1)).squeeze(-1)  # [..., n, sub, sub]
        return torch.einsum("...jrc,jl->...jrlc", scores, eye_n).reshape(*scores.shape[:-3], C, C)

    blk = torch.arange(C, device=k.device) // sub
    later_block = blk.unsqueeze(-1) > blk.unsqueeze(0)
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    A_qk = torch.where(later_block, off_blocks(qs), 0.0) + diag_blocks(qs)
    A_kk = torch.where(later_block, off_blocks(k), 0.0) + diag_blocks(k)
    return A_qk.masked_fill(~causal, 0.0), A_kk.masked_fill(~causal.tril(-1), 0.0)


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunked; same semantics as ``naive_recurrent_kda``.

    Args:
        q: queries ``[B, T, H, K]``, already L2-normalised over ``K`` by the caller.
        k: keys ``[B, T, H, K]``, already L2-normalised over ``K`` by the caller.
        v: values ``[B, T, H, V]``.
        g: per-key log-decay ``[B, T, H, K]``, ``<= 0``.
        beta: delta-rule write strength ``[B, T, H]``.
        scale: query scale; defaults to ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state before the first token, or None for zeros.
        output_final_state: whether to return the state after the last token.
        chunk_size: tokens per chunk; ``T`` need not be a multiple of it.

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, H, V]`` in ``v.dtype``; ``final_state`` is
        ``[B, H, K, V]`` in the compute dtype (fp32, or fp64 for fp64 inputs) or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if scale is None:
        scale = K**-0.5
    cdt = torch.promote_types(q.dtype, torch.float32)
    out_dtype = v.dtype
    NT = max(1, math.ceil(T / C))
    pad = NT * C - T

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B, H, NT, C, D]
        # Padding with k = 0, beta = 0, g = 0 makes the padded steps the identity on the state,
        # so the final state is unaffected; their outputs are sliced off.
        x = F.pad(x.to(cdt), (0, 0, 0, 0, 0, pad))
        return x.view(B, NT, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = (to_chunks(x) for x in (q, k, v, g))
    beta = to_chunks(beta.unsqueeze(-1))  # [B, H, NT, C, 1]
    qs = q * scale
    G = g.cumsum(-2)

    A_qk, A_kk = _intra_chunk_scores(qs, k, G, math.gcd(C, _SUB))
    eye = torch.eye(C, dtype=cdt, device=q.device)
    # One triangular solve yields both halves of delta = U - W S_0.
    rhs = beta * torch.cat([v, k * G.exp()], dim=-1)
    UW = torch.linalg.solve_triangular(eye + beta * A_kk, rhs, upper=False, unitriangular=True)
    U, W = UW.split([V, K], dim=-1)

    G_last = G[..., -1:, :]  # [B, H, NT, 1, K]
    q_decayed = qs * G.exp()  # reads S_0 through the decay accumulated up to each token
    k_to_end = k * (G_last - G).exp()  # each token's write, decayed to the chunk end
    chunk_decay = G_last.exp().transpose(-1, -2)  # [B, H, NT, K, 1]

    S = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        S = S + initial_state.to(cdt)
    outputs = []
    for n in range(NT):
        delta = U[:, :, n] - W[:, :, n] @ S  # [B, H, C, V]
        outputs.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ delta)
        S = chunk_decay[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ delta

    o = torch.stack(outputs, dim=2)  # [B, H, NT, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, NT * C, H, V)[:, :T]
    return o.to(out_dtype), (S if output_final_state else None)
