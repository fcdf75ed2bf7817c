"""FP8 grouped GEMM for the routed experts (``precision.recipe=fp8``), forward and backward.

``Fp8GroupedGemm`` is the ``grouped_gemm`` hook of ``moe.GroupedExperts``:
``(x [M, K], w [G, K, N], offs [G] int32) -> [M, N]``, rows ``offs[g-1]:offs[g]`` times ``w[g]``.
All three GEMMs of a grouped linear run in float8 E4M3 with power-of-two scales, as torchao's
MoE training does (``torchao.prototype.moe_training``, torchao 0.18):

  * forward ``y = x w[g]``: x scaled per row (amax over K), w per expert and output column
    (amax over K, ``[G, N]`` scales);
  * input gradient ``dx = dy w[g]^T``: dy per row (amax over N), w per expert and input row
    (amax over N, ``[G, K]`` scales);
  * weight gradient ``dw[g] = x_g^T dy_g``: x and dy per expert and column, the amax taken over
    that expert's rows only (``[G, K]`` and ``[G, N]`` scales).

Every scale is ``2 ** floor(log2(448 / amax))`` (amax in fp32, floored at 1e-12; 448 is E4M3's
largest value), so scaling is exact and an element's only error is its E4M3 rounding
(round-to-nearest-even, saturating at +-448): a relative error of at most 2^-4 = 6.25% for a
normal E4M3 value, and an absolute error of at most 2^-10 / scale below E4M3's smallest normal
2^-6 (``tests/quant/test_fp8_grouped.py`` states the product bound derived from it).

Two implementations of the same arithmetic:
  * ``emulate=False`` (CUDA, compute capability >= 8.9): torchao's
    ``_to_fp8_rowwise_then_scaled_grouped_mm``: Triton quantisation kernels and
    ``torch._scaled_grouped_mm`` (CUTLASS, fp32 accumulation with Hopper's fast fp8
    accumulation, bf16 output: the only output dtype torch allows; cast to x's dtype). Its
    layout rules: x row-major with K a multiple of 16, the weight column-major ``[G, K, N]``
    (strides ``(K*N, 1, K)``) with K and N multiples of 16, and every group's row count a
    multiple of 16 (torchao's own padding is not implemented in 0.18), so
    ``group_alignment = 16`` and ``GroupedExperts`` pads the groups with zero rows
    (``moe.group_pad``: no host sync, no empty group). The weight is cast to x's dtype and
    made column-major in one copy (the copy autocast makes anyway).
  * ``emulate=True`` (any device; CPU tests, and on GPU a reference for the kernel): the same
    scales and E4M3 rounding (torch's ``float8_e4m3fn`` cast), dequantised, and the GEMMs in
    fp32 per expert. It reads the group offsets on the host.

The weights stay in their own dtype in the module and the checkpoint: float8 exists only
inside the GEMM.
"""
from __future__ import annotations

import torch

from k3train.errors import UsageError

E4M3_MAX = 448.0
_EPS = 1e-12          # torchao's amax floor: an all-zero row gets a finite scale
GROUP_ALIGNMENT = 16  # rows per group for torch._scaled_grouped_mm's float8 operands


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2 ** floor(log2(448 / amax))`` in fp32, elementwise; amax: fp32, any shape.

    As torchao computes it: the quotient in fp64, rounded to fp32, then rounded down to a power
    of two (here exactly, from the fp32 exponent; frexp gives s = m * 2**e with m in [0.5, 1)).
    """
    s = (E4M3_MAX / amax.clamp(min=_EPS).double()).float()
    return torch.ldexp(torch.ones_like(s), torch.frexp(s).exponent - 1)


def quantize_e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t * scale`` rounded to E4M3 (nearest even, saturating at +-448), as float8_e4m3fn.
    t: any shape; scale: fp32, broadcastable to t."""
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fake_quant_e4m3(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t quantised to E4M3 with one power-of-two scale per slice along ``dim`` (the amax is
    taken over ``dim``), then dequantised: fp32, t's shape."""
    scale = pow2_scale(t.detach().abs().float().amax(dim=dim, keepdim=True))
    return quantize_e4m3(t, scale).float() / scale


def fake_quant_e4m3_grouped_cols(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """t: ``[M, C]`` rows grouped by ``offs`` ([G] cumulative ends) -> fp32 ``[M, C]``, each
    column of each group scaled by the amax over that group's rows (the weight-gradient
    scaling). Rows past ``offs[-1]`` belong to no group and come back as zeros."""
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    used = int(offs[-1]) if offs.numel() else 0
    group = torch.repeat_interleave(torch.arange(offs.numel(), device=t.device), counts.to(t.device))
    mag = t[:used].detach().abs().float()
    amax = mag.new_zeros(offs.numel(), t.shape[1]).scatter_reduce_(
        0, group[:, None].expand_as(mag), mag, "amax")
    scale = pow2_scale(amax)[group]
    out = t.new_zeros(t.shape, dtype=torch.float32)
    out[:used] = quantize_e4m3(t[:used], scale).float() / scale
    return out


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a ``[M, K]`` fp32, b ``[G, K, N]`` fp32 -> ``[M, N]`` (rows past offs[-1]: zeros)."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    for g, (lo, hi) in enumerate(_bounds(offs)):
        out[lo:hi] = a[lo:hi] @ b[g]
    return out


def _grouped_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a ``[M, K]``, b ``[M, N]`` fp32 -> ``[G, K, N]``: ``a_g^T b_g`` per group (zero if empty)."""
    out = a.new_zeros(offs.numel(), a.shape[1], b.shape[1])
    for g, (lo, hi) in enumerate(_bounds(offs)):
        out[g] = a[lo:hi].T @ b[lo:hi]
    return out


class EmulatedFp8GroupedMM(torch.autograd.Function):
    """``(x [M, K], w [G, K, N], offs [G] int32) -> [M, N]`` in x's dtype: the FP8 grouped GEMM
    with torchao's scaling (module docstring), E4M3 rounding emulated, products in fp32.
    Gradients: dx in x's dtype, dw in w's dtype; each backward GEMM quantises its operands
    with its own scales, as the GPU kernel does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        # Autocast would run the fp32 products in bf16; every dtype here is explicit.
        with torch.autocast(x.device.type, enabled=False):
            y = _grouped_matmul(fake_quant_e4m3(x, dim=1), fake_quant_e4m3(w, dim=1), offs)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        with torch.autocast(dy.device.type, enabled=False):
            # dgrad: w^T [G, N, K] scaled per (expert, k) over N.
            dx = _grouped_matmul(fake_quant_e4m3(dy, dim=1), fake_quant_e4m3(w, dim=2).mT, offs)
            dw = _grouped_wgrad(fake_quant_e4m3_grouped_cols(x, offs),
                                fake_quant_e4m3_grouped_cols(dy, offs), offs)
        return dx.to(x.dtype), dw.to(w.dtype), None


def _column_major(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w ``[G, K, N]`` -> the same values in ``dtype`` with strides ``(K*N, 1, K)``: one copy.
    (``to`` casts and transposes in one pass; when the dtype already matches it returns the
    view unchanged, and ``contiguous`` makes the copy instead.)"""
    return w.mT.to(dtype, memory_format=torch.contiguous_format).contiguous().mT


class Fp8GroupedGemm:
    """The FP8 grouped GEMM as ``GroupedExperts``' ``grouped_gemm`` hook:
    ``(x [M, K], w [G, K, N], offs [G] int32) -> [M, N]`` in x's dtype, differentiable in x and
    w. ``emulate``: the exact emulation (any device) instead of torchao's kernel (CUDA, x in
    bf16 or fp32, K and N multiples of 16, rows grouped in multiples of 16). Not an
    ``nn.Module``: it holds no state, so the experts keep their state dict."""

    def __init__(self, *, emulate: bool = False):
        self.emulate = emulate
        # The kernel needs every group padded to 16 rows; the emulation needs nothing.
        self.group_alignment = 1 if emulate else GROUP_ALIGNMENT
        self._kernel = None if emulate else _torchao_kernel()

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self.emulate:
            return EmulatedFp8GroupedMM.apply(x, w.to(x.dtype), offs)
        w_t = _column_major(w, x.dtype)
        # Every dtype is explicit (float8 operands, bf16 out); autocast must not recast them.
        with torch.autocast(x.device.type, enabled=False):
            # torch._scaled_grouped_mm writes bf16 only; an fp32 x (no autocast) gets its
            # output cast back, and autograd casts the bf16 input gradient to x's dtype.
            y = self._kernel(x, w_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
        return y.to(x.dtype)

    def __repr__(self) -> str:
        return f"Fp8GroupedGemm(emulate={self.emulate})"


def _torchao_kernel():
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    except ImportError as exc:
        raise UsageError(f"precision.recipe=fp8 on routed experts needs torchao's FP8 grouped GEMM "
                         f"(torchao.prototype.moe_training, torchao 0.18): {exc}; drop "
                         f"'\\.ffn\\.experts$' from precision.scope to keep them in bf16") from None
    return _to_fp8_rowwise_then_scaled_grouped_mm
