"""Kimi Delta Attention ops: recurrent oracle, chunked pure-torch form, and backend dispatch.

``kda`` runs fla's Triton ``chunk_kda`` on CUDA tensors when the kernel registry picks fla for
the ``kda`` family (``kernels.kda``; fla must be installed), else ``chunk_kda_torch``. All paths share fla's conventions: q,k ``[B, T, H, K]`` (L2-normalised by
the caller), v ``[B, T, H, V]``, g per-key log-decay ``[B, T, H, K]``, beta ``[B, T, H]``,
state ``[B, H, K, V]`` in fp32.
"""

from __future__ import annotations

import torch

from k3train.config import layout_rules
from k3train.ops import fla_kernel
from k3train.ops.kda.chunk import chunk_kda_torch
from k3train.ops.kda.naive import naive_recurrent_kda

__all__ = ["chunk_kda_torch", "fla_kda_varlen", "kda", "kda_backend", "kda_gated", "kda_gated_state",
           "kda_torch_varlen", "l2norm", "naive_recurrent_kda", "L2NORM_EPS"]

# fla's in-kernel q/k normalisation (fla/modules/l2norm.py: ``x / sqrt(sum(x^2) + eps)`` in fp32,
# eps 1e-6): the torch path uses the same form so both paths agree for small-norm inputs too.
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x ``[..., K]`` -> ``x / sqrt(sum(x^2, -1) + eps)`` (same shape and dtype), computed in fp32
    at least: fla's kernel form, with the epsilon inside the square root (not a clamped norm)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(ct)
    return (xc * torch.rsqrt(xc.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _fla_chunk_kda(device):
    return fla_kernel("kda", device, "fla.ops.kda", "chunk_kda")


def kda_backend(device: torch.device | str) -> str:
    """Which implementation ``kda`` runs for tensors on ``device``: ``"fla"`` or ``"torch"``."""
    return "fla" if _fla_chunk_kda(device) is not None else "torch"


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention on the fastest available backend.

    Args:
        q: queries ``[B, T, H, K]``, already L2-normalised over ``K``.
        k: keys ``[B, T, H, K]``, already L2-normalised over ``K``.
        v: values ``[B, T, H, V]``.
        g: per-key log-decay ``[B, T, H, K]``, ``<= 0`` (already through the gate activation).
        beta: delta-rule write strength ``[B, T, H]``, already through the sigmoid.
        scale: query scale; defaults to ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state before the first token, or None.
        output_final_state: whether to return the state after the last token.
        cu_seqlens: document boundaries, LongTensor ``[N+1]`` over the ``B*T`` tokens flattened
            row by row (``k3train.ops.documents``): the state restarts from zero at each; with
            it ``initial_state`` and ``final_state`` are per document, ``[N, H, K, V]``.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``v.dtype``; ``final_state``
        ``[B, H, K, V]`` (fp32) or None.
    """
    fla_chunk_kda = _fla_chunk_kda(q.device)
    if fla_chunk_kda is not None and cu_seqlens is not None:
        return fla_kda_varlen(
            fla_chunk_kda, cu_seqlens, q.to(v.dtype), k.to(v.dtype), v, g.float(), beta.to(v.dtype), scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)
    if cu_seqlens is not None:
        return kda_torch_varlen(q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state)
    if fla_chunk_kda is not None:
        # Matched to fla 0.6.0 (fla-core 0.6.0, fla/ops/kda/chunk.py):
        #   chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        #             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        #             use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
        #             lower_bound=None, ..., cu_seqlens=None, ...) -> (o, final_state)
        # q,k arrive normalised, g is already the log-decay and beta already a sigmoid, so the
        # in-kernel l2norm / gate / beta-sigmoid flags are pinned off. fla asserts an fp32 state.
        if initial_state is not None:
            initial_state = initial_state.float()
        # fla's Triton dots need q, k, v, beta in one dtype (under autocast the projections
        # come out bf16 while normalised q, k may be fp32); the log-decay g stays fp32.
        dt = v.dtype
        return fla_chunk_kda(
            q.to(dt),
            k.to(dt),
            v,
            g.float(),
            beta.to(dt),
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=False,
        )
    return chunk_kda_torch(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state
    )


def kda_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """KDA from raw projections, with K3's safe gate: the layer's whole recurrence in one call.

    Computes ``kda(l2norm(q), l2norm(k), v, g, sigmoid(beta_logits))`` with the bounded log-decay
    ``g = lower_bound * sigmoid(exp(A_log)[:, None] * (f + dt_bias))`` in ``(lower_bound, 0)``.

    Args:
        q, k: ``[B, T, H, K]`` before normalisation; v: ``[B, T, H, V]``.
        f: gate pre-activation ``[B, T, H, K]``; beta_logits: ``[B, T, H]``.
        A_log: ``[H]``; dt_bias: ``[H, K]``; lower_bound: a negative float.
        cu_seqlens: document boundaries ``[N+1]`` over the flattened ``B*T`` tokens, or None
            (one sequence per row); the recurrence restarts from zero at each (``kda``).

    Returns:
        o ``[B, T, H, V]`` in ``v.dtype``.

    On fla, the normalisation, the gate and the beta sigmoid run inside the kernel, and the
    bounded gate lets it take its safe-gate path (``safe_gate=True``, 16-row tensor-core tiles),
    which is what fla's own layer does; elsewhere they run in torch (fp32 at least) first.
    """
    return kda_gated_state(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, cu_seqlens=cu_seqlens)[0]


def kda_gated_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``kda_gated`` continuing from ``initial_state`` ``[B, H, K, V]`` (fp32), for the inference
    cache's prefill: ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] fp32 or None)``.

    The cache prefills through the training layer's own call (same gate, same normalisation,
    same kernel), so a prefill reproduces the full forward's KDA outputs instead of differing from
    them by another kernel's rounding (fla's dots run in tf32 even on fp32 inputs: both of fla's
    chunked paths were measured at about 1e-3 from an fp64 recurrence on an H200,
    ``scripts/gpu_check_kda_cache.py``)."""
    fla_chunk_kda = _fla_chunk_kda(q.device)
    if fla_chunk_kda is not None:
        dt = v.dtype
        kwargs = dict(
            A_log=A_log.float(), dt_bias=dt_bias.reshape(-1).float(),
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=True, lower_bound=lower_bound,
        )
        if cu_seqlens is not None:
            return fla_kda_varlen(fla_chunk_kda, cu_seqlens, q.to(dt), k.to(dt), v, f, beta_logits.to(dt),
                                  **kwargs)
        return fla_chunk_kda(q.to(dt), k.to(dt), v, f, beta_logits.to(dt), **kwargs)
    ct = torch.promote_types(v.dtype, torch.float32)  # fp32 at least; fp64 stays fp64 (tests)
    q = l2norm(q.to(ct)).to(v.dtype)
    k = l2norm(k.to(ct)).to(v.dtype)
    a = torch.exp(A_log.to(ct))[:, None]
    g = lower_bound * torch.sigmoid(a * (f.to(ct) + dt_bias.to(ct)))
    return kda(q, k, v, g, torch.sigmoid(beta_logits.to(ct)), initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


class _OwnGradients(torch.autograd.Function):
    """Identity on its tensors whose backward copies each incoming gradient (see
    ``fla_kda_varlen``): one copy per input per layer, so no gradient aliases a buffer that a
    later call rewrites (a leaf's ``.grad`` would otherwise take the buffer itself)."""

    @staticmethod
    def forward(ctx, *xs: torch.Tensor):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        return tuple(None if g is None else g.clone() for g in grads)


def fla_kda_varlen(fla_chunk_kda, cu_seqlens: torch.Tensor, q, k, v, g, beta, **kwargs):
    """fla's ``chunk_kda`` over the documents of ``cu_seqlens``: the GPU path of document masking.

    fla's varlen convention (fla/ops/kda/chunk.py, ``cu_seqlens``): the batch is flattened to one
    row, ``[1, B*T, ...]``, and ``cu_seqlens`` ``[N+1]`` (int64, on the tensors' device, starting
    at 0 and ending at ``B*T``, every row start included) lists where each document starts; the
    kernel restarts the state at each, and ``initial_state`` / ``final_state`` are ``[N, H, K, V]``.
    q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H, K]``, beta ``[B, T, H]``; ``kwargs``
    go to fla unchanged. Returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)``."""
    B, T = q.shape[:2]
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    graphable = T < layout_rules.PER_DOCUMENT_MIN_WINDOW   # windows a CUDA graph may record
    if graphable and kwargs.get("initial_state") is None and not kwargs.get("output_final_state"):
        # fla's fixed-shape chunk list, built on the device (use_graph): a CUDA-graphed step
        # records it, zero-length documents (document_cu_seqlens_padded) are skipped, and no
        # call reads the boundaries on the host. Its backward keeps work buffers (fp32, the
        # size of q, k and g) for the life of the process, so longer windows, which are never
        # graphed, and runs with states (context parallelism) take the plain varlen path.
        kwargs = {**kwargs, "use_graph": True}
        # Under use_graph fla's backward hands some gradients back in process-wide static
        # buffers (fla/ops/utils/graph.py) that the next KDA backward overwrites: own them.
        flat = list(_OwnGradients.apply(*flat))
    o, state = fla_chunk_kda(*flat, cu_seqlens=cu_seqlens, **kwargs)
    return o.reshape(B, T, *o.shape[2:]), state


def kda_torch_varlen(q, k, v, g, beta, cu_seqlens: torch.Tensor, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """``chunk_kda_torch`` run on each document of ``cu_seqlens`` alone (the CPU reference of
    document masking): the same shapes and convention as ``fla_kda_varlen``. Each document is
    its own call from a zero (or its ``initial_state[n]``) state, so a packed window equals its
    documents run one by one, by construction."""
    B, T = q.shape[:2]
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi == lo and not output_final_state:   # padding (document_cu_seqlens_padded)
            continue
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, s = chunk_kda_torch(*(x[:, lo:hi] for x in flat), scale=scale, initial_state=h0,
                               output_final_state=output_final_state)
        outs.append(o)
        states.append(s)
    o = torch.cat(outs, dim=1).reshape(B, T, *v.shape[2:])
    return o, (torch.cat(states) if output_final_state else None)
