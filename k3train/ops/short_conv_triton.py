"""Causal depthwise short convolution + SiLU as two Triton kernels (forward, backward).

Same contract as ``short_conv_silu_torch``: x ``[B, T, C]``, weight ``[C, W]`` ->
``silu(z)`` with ``z[t] = sum_j weight[:, j] * x[t - W + 1 + j]`` (zeros before token 0).

Why ours and not fla's ``causal_conv1d``: fla's backward first re-runs its forward to
materialise the pre-activation (a read of x and a write of z), then reads x, z and dy and writes
dx. This backward recomputes z in registers from x: each strip of rows reads x and dy once
(plus a W-1 row halo) and writes dx, ~3 passes over ``[B, T, C]`` instead of ~6 (measured with
``benchmarks/bench_kda_layer.py``: see benchmarks/README.md).

The weight gradient is reduced per strip of rows into ``[strips, W, C]`` fp32 partials (C
contiguous, so the stores coalesce) and summed over strips by torch.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["short_conv_silu_triton"]

# Each program streams one [rows, BC] strip of one sequence row by row, keeping the W-1
# previous rows (forward) or the W-1 next rows' dz (backward) in registers: every element of
# x and dy is read from memory about once. (A first version loaded W shifted [BT, BC] tiles per
# tap and recomputed z for each: ~24 tile loads per element through L2, slower than fla's;
# measured: see benchmarks/README.md.)
_CONFIGS = [triton.Config({"BC": bc, "ROWS": rows}, num_warps=w)
            for bc, rows, w in ((256, 32, 2), (512, 32, 4), (512, 64, 4), (1024, 32, 4), (256, 64, 2),
                                (256, 16, 2), (512, 16, 4), (128, 32, 1))]


@triton.jit
def _rows_mask(mc, ok):
    """``mc & ok`` for a channel mask ``mc`` [BC] and a scalar row condition ``ok``, written as a
    select: Triton 3.9's CPU interpreter types ``block & scalar`` comparisons as int32, which its
    masked loads and stores refuse (``mask has unsupported dtype``); compiled, both are one and."""
    return tl.where(ok, mc, False)


@triton.jit
def _load_taps(w_ptr, c, mc, W: tl.constexpr):
    """The W <= 4 tap weights of channels ``c`` as fp32 ``[BC]`` vectors (zeros past W)."""
    w0 = tl.load(w_ptr + c * W + 0, mask=mc, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * W + 1, mask=mc & (W > 1), other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * W + 2, mask=mc & (W > 2), other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * W + 3, mask=mc & (W > 3), other=0.0).to(tl.float32)
    return w0, w1, w2, w3


@triton.jit
def _preact(w0, w1, w2, w3, x3, x2, x1, x0, W: tl.constexpr):
    """z[t] from the window x3 = x[t-3], ..., x0 = x[t]: taps align to the newest row, so
    weight[:, W-1] multiplies x[t]."""
    if W == 4:
        z = w0 * x3 + w1 * x2 + w2 * x1 + w3 * x0
    elif W == 3:
        z = w0 * x2 + w1 * x1 + w2 * x0
    else:
        z = w0 * x1 + w1 * x0
    return z


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, y_ptr, T, C, W: tl.constexpr, BC: tl.constexpr, ROWS: tl.constexpr):
    pid_c, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = pid_c * BC + tl.arange(0, BC)
    mc = c < C
    base = b.to(tl.int64) * T * C
    w0, w1, w2, w3 = _load_taps(w_ptr, c, mc, W)
    t0 = pid_t * ROWS
    # The window x[t-3], x[t-2], x[t-1] before the first row (zeros before token 0).
    xm3 = tl.load(x_ptr + base + (t0 - 3) * C + c, mask=_rows_mask(mc, t0 >= 3), other=0.0).to(tl.float32)
    xm2 = tl.load(x_ptr + base + (t0 - 2) * C + c, mask=_rows_mask(mc, t0 >= 2), other=0.0).to(tl.float32)
    xm1 = tl.load(x_ptr + base + (t0 - 1) * C + c, mask=_rows_mask(mc, t0 >= 1), other=0.0).to(tl.float32)
    for k in tl.range(0, ROWS, num_stages=3):
        t = t0 + k
        x0 = tl.load(x_ptr + base + t * C + c, mask=_rows_mask(mc, t < T), other=0.0).to(tl.float32)
        z = _preact(w0, w1, w2, w3, xm3, xm2, xm1, x0, W)
        tl.store(y_ptr + base + t * C + c, (z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=_rows_mask(mc, t < T))
        xm3, xm2, xm1 = xm2, xm1, x0


@triton.jit
def _bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, T, C, W: tl.constexpr, BC: tl.constexpr,
                ROWS: tl.constexpr):
    """Rows from last to first: z[t] from x[t-W+1..t], dz[t] = dy[t] silu'(z[t]);
    dx[t] = sum_i w[W-1-i] dz[t+i]; dw[:, j] partial = sum_t dz[t] x[t-W+1+j]."""
    pid_c, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = pid_c * BC + tl.arange(0, BC)
    mc = c < C
    base = b.to(tl.int64) * T * C
    w0, w1, w2, w3 = _load_taps(w_ptr, c, mc, W)
    t0 = pid_t * ROWS
    t1 = t0 + ROWS
    # Start W-1 rows past the strip (their dz feed dx of its last rows; nothing is stored for
    # them), and carry x[t-1], x[t-2], x[t-3] into each row as the walk goes backwards. Rows
    # past the sequence load zeros (dy = 0 there, so their dz is 0).
    start = t1 + W - 2
    xa = tl.load(x_ptr + base + start * C + c, mask=_rows_mask(mc, start < T), other=0.0).to(tl.float32)
    xb = tl.load(x_ptr + base + (start - 1) * C + c, mask=_rows_mask(mc, start - 1 < T), other=0.0).to(tl.float32)
    xc = tl.load(x_ptr + base + (start - 2) * C + c, mask=_rows_mask(mc, (start - 2 < T) & (start >= 2)),
                 other=0.0).to(tl.float32)
    dz1 = tl.zeros((BC,), dtype=tl.float32)  # dz[t+1], dz[t+2], dz[t+3]
    dz2 = tl.zeros((BC,), dtype=tl.float32)
    dz3 = tl.zeros((BC,), dtype=tl.float32)
    dw0 = tl.zeros((BC,), dtype=tl.float32)
    dw1 = tl.zeros((BC,), dtype=tl.float32)
    dw2 = tl.zeros((BC,), dtype=tl.float32)
    dw3 = tl.zeros((BC,), dtype=tl.float32)
    for k in tl.range(0, ROWS + W - 1, num_stages=3):
        t = start - k
        xd = tl.load(x_ptr + base + (t - 3) * C + c, mask=_rows_mask(mc, (t >= 3) & (t - 3 < T)),
                     other=0.0).to(tl.float32)
        z = _preact(w0, w1, w2, w3, xd, xc, xb, xa, W)
        dyv = tl.load(dy_ptr + base + t * C + c, mask=_rows_mask(mc, t < T), other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        dz = dyv * sig * (1.0 + z * (1.0 - sig))
        if W == 4:
            dx = w3 * dz + w2 * dz1 + w1 * dz2 + w0 * dz3
        elif W == 3:
            dx = w2 * dz + w1 * dz1 + w0 * dz2
        else:
            dx = w1 * dz + w0 * dz1
        own = (t < t1) & (t < T)  # rows of this strip (the first W-1 steps only warm the window)
        tl.store(dx_ptr + base + t * C + c, dx.to(dx_ptr.dtype.element_ty), mask=_rows_mask(mc, own))
        dzo = tl.where(own, dz, 0.0)
        if W == 4:
            dw0 += dzo * xd
            dw1 += dzo * xc
            dw2 += dzo * xb
            dw3 += dzo * xa
        elif W == 3:
            dw0 += dzo * xc
            dw1 += dzo * xb
            dw2 += dzo * xa
        else:
            dw0 += dzo * xb
            dw1 += dzo * xa
        dz3, dz2, dz1 = dz2, dz1, dz
        xa, xb, xc = xb, xc, xd
    tile = (b * tl.num_programs(1) + pid_t).to(tl.int64)
    tl.store(dw_ptr + (tile * W + 0) * C + c, dw0, mask=mc)
    tl.store(dw_ptr + (tile * W + 1) * C + c, dw1, mask=mc & (W > 1))
    tl.store(dw_ptr + (tile * W + 2) * C + c, dw2, mask=mc & (W > 2))
    tl.store(dw_ptr + (tile * W + 3) * C + c, dw3, mask=mc & (W > 3))


# Autotuned on a GPU (keyed on the channel count and width); Triton's CPU interpreter (what the
# tests run) cannot time kernels, so there one fixed config runs. cache_results keeps the
# choice on disk (in the Triton cache) for the next process.
_fwd_tuned = triton.autotune(configs=_CONFIGS, key=["C", "W"], cache_results=True)(_fwd_kernel)
_bwd_tuned = triton.autotune(configs=_CONFIGS, key=["C", "W"], cache_results=True)(_bwd_kernel)
_INTERPRET_CONFIG = {"BC": 32, "ROWS": 16}
_MIN_ROWS = min(cfg.kwargs["ROWS"] for cfg in _CONFIGS)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _launch(kernel, tuned, B: int, T: int, C: int, *args, **kwargs) -> int:
    """Launch on a ``[C / BC, T / ROWS, B]`` grid; returns the ROWS that ran."""
    if _interpreting():
        cfg = _INTERPRET_CONFIG
        kernel[(triton.cdiv(C, cfg["BC"]), triton.cdiv(T, cfg["ROWS"]), B)](*args, **kwargs, **cfg)
        return cfg["ROWS"]
    tuned[lambda meta: (triton.cdiv(C, meta["BC"]), triton.cdiv(T, meta["ROWS"]), B)](*args, **kwargs)
    # Set by the launch just made; absent when nothing ran (compile_ahead's compile-only
    # launches, whose outputs are discarded): then any count within the buffer will do.
    best = getattr(tuned, "best_config", None)
    return best.kwargs["ROWS"] if best is not None else _MIN_ROWS


class _ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x, w = x.contiguous(), weight.to(x.dtype).contiguous()
        y = torch.empty_like(x)
        _launch(_fwd_kernel, _fwd_tuned, B, T, C, x, w, y, T, C, W=w.shape[1])
        ctx.save_for_backward(x, w)
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        B, T, C = x.shape
        W = w.shape[1]
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        # One partial per (batch, strip), every one written; the strip count depends on the
        # autotuned ROWS, so size for the smallest and sum the strips that ran.
        min_rows = _INTERPRET_CONFIG["ROWS"] if _interpreting() else _MIN_ROWS
        dw = torch.empty(B * triton.cdiv(T, min_rows), W, C, dtype=torch.float32, device=x.device)
        rows = _launch(_bwd_kernel, _bwd_tuned, B, T, C, x, w, dy, dx, dw, T, C, W=W)
        return dx, dw[:B * triton.cdiv(T, rows)].sum(0).t().to(ctx.weight_dtype)


def short_conv_silu_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, C]``, weight ``[C, W]`` -> ``silu(causal depthwise conv)`` ``[B, T, C]``."""
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1] or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"short conv: x must be [B, T, C] and weight [C, W] with 2 <= W <= 4, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    return _ShortConvSiLU.apply(x, weight)
