"""Token-by-token KDA recurrence: the readable oracle the chunked and fused paths are tested against.

Per batch element and head, with state ``S`` in ``R^{K x V}``::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)
"""

from __future__ import annotations

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, one token at a time.

    Args:
        q: queries ``[B, T, H, K]``, already L2-normalised over ``K`` by the caller
            (this function does not normalise).
        k: keys ``[B, T, H, K]``, already L2-normalised over ``K`` by the caller.
        v: values ``[B, T, H, V]``.
        g: per-key log-decay ``[B, T, H, K]``, ``<= 0`` (the decay applied is ``exp(g)``).
        beta: delta-rule write strength ``[B, T, H]``, typically in ``(0, 1)``.
        scale: query scale; defaults to ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state before the first token, or None for zeros.
        output_final_state: whether to return the state after the last token.

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, H, V]`` in ``v.dtype``; ``final_state`` is
        ``[B, H, K, V]`` in the compute dtype (fp32, or fp64 for fp64 inputs) or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    # fp32 matches the kernels' accumulation; fp64 inputs stay fp64 so tests can be tight.
    cdt = torch.promote_types(q.dtype, torch.float32)
    out_dtype = v.dtype
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))

    S = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        S = S + initial_state.to(cdt)
    outputs = []
    for t in range(T):
        k_t = k[:, t]
        S = S * g[:, t].exp().unsqueeze(-1)
        # (I - b k k^T) X + b k v^T == X + b k (v - X^T k)^T: a rank-1 update instead of a K x K matrix.
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + beta[:, t, :, None, None] * k_t.unsqueeze(-1) * err.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))

    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)
