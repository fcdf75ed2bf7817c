"""Muon's momentum and Nesterov input in one Triton pass per matrix.

torch needs two passes: ``buf = g + mu * buf`` (read g, buf; write buf) and then
``u = g + mu * buf`` (read g, buf again; write u). This kernel reads g and buf once and writes
both, 3 fp32 + 1 bf16 accesses per element instead of 5 + 1: on k3_mini's 45 stacked
``[64, 512, 512]`` fp32 expert weights ~6 GB less memory traffic per optimizer step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["momentum_nesterov_triton"]

_BLOCK = 4096


@triton.jit
def _momentum_kernel(g_ptr, buf_ptr, u_ptr, n, mu, NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    buf = tl.load(buf_ptr + offs, mask=mask).to(tl.float32)
    buf = g + mu * buf
    tl.store(buf_ptr + offs, buf.to(buf_ptr.dtype.element_ty), mask=mask)
    u = g + mu * buf if NESTEROV else buf
    tl.store(u_ptr + offs, u.to(u_ptr.dtype.element_ty), mask=mask)


def momentum_nesterov_triton(g: torch.Tensor, buf: torch.Tensor, u: torch.Tensor,
                             momentum: float, nesterov: bool) -> None:
    """In place: ``buf = g + momentum * buf``; ``u = g + momentum * buf`` (nesterov) or
    ``u = buf``, cast to ``u``'s dtype. g, buf, u: contiguous tensors of one shape. All in
    fp32; u uses the new momentum before its rounding to a narrower state dtype."""
    if not (g.shape == buf.shape == u.shape and g.is_contiguous() and buf.is_contiguous()
            and u.is_contiguous()):
        raise ValueError(f"momentum_nesterov_triton needs contiguous g, buf, u of one shape, got "
                         f"{tuple(g.shape)}, {tuple(buf.shape)}, {tuple(u.shape)}")
    n = g.numel()
    if n:
        _momentum_kernel[(triton.cdiv(n, _BLOCK),)](g, buf, u, n, momentum, NESTEROV=nesterov,
                                                    BLOCK=_BLOCK, num_warps=8)
