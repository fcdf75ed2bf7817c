"""Kimi Delta Attention ops: recurrent oracle, chunked pure-torch form, and backend dispatch.

``kda`` runs fla's Triton ``chunk_kda`` on CUDA tensors when the kernel registry picks fla for
the ``kda`` family (``kernels.kda``; fla must be installed), else ``chunk_kda_torch``. All paths share fla's conventions: q,k ``[B, T, H, K]`` (L2-normalised by
the caller), v ``[B, T, H, V]``, g per-key log-decay ``[B, T, H, K]``, beta ``[B, T, H]``,
state ``[B, H, K, V]`` in fp32.
"""

from __future__ import annotations

import torch

from k3train.ops import fla_kernel
from k3train.ops.kda.chunk import chunk_kda_torch
from k3train.ops.kda.naive import naive_recurrent_kda

__all__ = ["chunk_kda_torch", "kda", "kda_backend", "kda_gated", "kda_gated_state", "naive_recurrent_kda"]


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

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``v.dtype``; ``final_state``
        ``[B, H, K, V]`` (fp32) or None.
    """
    fla_chunk_kda = _fla_chunk_kda(q.device)
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
) -> torch.Tensor:
    """KDA from raw projections, with K3's safe gate: the layer's whole recurrence in one call.

    Computes ``kda(l2norm(q), l2norm(k), v, g, sigmoid(beta_logits))`` with the bounded log-decay
    ``g = lower_bound * sigmoid(exp(A_log)[:, None] * (f + dt_bias))`` in ``(lower_bound, 0)``.

    Args:
        q, k: ``[B, T, H, K]`` before normalisation; v: ``[B, T, H, V]``.
        f: gate pre-activation ``[B, T, H, K]``; beta_logits: ``[B, T, H]``.
        A_log: ``[H]``; dt_bias: ``[H, K]``; lower_bound: a negative float.

    Returns:
        o ``[B, T, H, V]`` in ``v.dtype``.

    On fla, the normalisation, the gate and the beta sigmoid run inside the kernel, and the
    bounded gate lets it take its safe-gate path (``safe_gate=True``, 16-row tensor-core tiles),
    which is what fla's own layer does; elsewhere they run in torch (fp32 at least) first.
    """
    return kda_gated_state(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound)[0]


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
        return fla_chunk_kda(
            q.to(dt), k.to(dt), v, f, beta_logits.to(dt),
            A_log=A_log.float(), dt_bias=dt_bias.reshape(-1).float(),
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=True, lower_bound=lower_bound,
        )
    ct = torch.promote_types(v.dtype, torch.float32)  # fp32 at least; fp64 stays fp64 (tests)
    q = torch.nn.functional.normalize(q.to(ct), dim=-1).to(v.dtype)
    k = torch.nn.functional.normalize(k.to(ct), dim=-1).to(v.dtype)
    a = torch.exp(A_log.to(ct))[:, None]
    g = lower_bound * torch.sigmoid(a * (f.to(ct) + dt_bias.to(ct)))
    return kda(q, k, v, g, torch.sigmoid(beta_logits.to(ct)), initial_state=initial_state,
               output_final_state=output_final_state)
