"""Exact emulation of OCP Microscaling (MX) v1.0 block formats: MXFP4 (E2M1) and MXFP8 (E4M3).

An MX block is ``block_size`` elements ``P_i`` sharing one E8M0 scale ``X``; the value of element
``i`` is ``X * P_i``. Conversion follows the spec's "conversion from a vector of scalar floats to
MX format" (section 6.3 of the OCP Microscaling Formats (MX) v1.0 specification; the derivation
is in docs/quantization.md#mx-formats):

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem      (clamped to the E8M0 range [-127, 127])
    X          = 2 ** shared_exp
    P_i        = V_i / X rounded to the element format, round-to-nearest-even, saturating to +-max

Blocks run along the LAST dimension. Hopper has no MX hardware, so training uses this as
fake-quant (quantize then dequantize) with no loss of exactness versus a real MX encoder.

Special values (the same specification, section 5, "special value handling", and section 6.3). E8M0 has one special
encoding, NaN (byte 0xFF), and the spec says that when X is NaN every value of the block is NaN
regardless of the P_i. Neither E2M1 (no Inf/NaN codes at all) nor E4M3 (NaN only, no Inf) can
hold an infinity, and a shared exponent of floor(log2(Inf)) is outside the E8M0 range. So:
  * a block containing a NaN gets a NaN scale: the whole block dequantizes to NaN;
  * a block containing +-Inf is treated the same way (NaN scale, whole block NaN). Saturating Inf
    to +-max would turn an overflow into a plausible finite number and hide it from the trainer's
    finite-loss check; the NaN scale is the only non-finite value the format can store, so it is
    the faithful encoding of "this block is not representable".

Compute happens in fp32 (fp64 for fp64 inputs, which lets tests reach the upper E8M0 clamp);
every step is exact: scaling is by powers of two built from their bit patterns, and rounding is
``torch.round`` (ties-to-even) on a grid where the element's ulp is 1.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ElemFormat:
    """A small binary float format: 1 sign bit, ``ebits`` exponent bits, ``mbits`` mantissa bits."""

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int  # unbiased exponent of the largest normal value
    max_normal: float
    has_nan: bool  # E4M3: S.1111.111 is NaN; E2M1 has no special codes

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal (subnormals share it, with a 0 leading bit)."""
        return 1 - self.bias

    @property
    def nbits(self) -> int:
        return 1 + self.ebits + self.mbits


ELEM_FORMATS = {
    "e2m1": ElemFormat("e2m1", ebits=2, mbits=1, bias=1, emax=2, max_normal=6.0, has_nan=False),
    "e4m3": ElemFormat("e4m3", ebits=4, mbits=3, bias=7, emax=8, max_normal=448.0, has_nan=True),
}

E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_EMIN, SCALE_EMAX = -127, 127


def _elem_format(elem: str) -> ElemFormat:
    if elem not in ELEM_FORMATS:
        raise ValueError(f"unknown MX element format {elem!r}; allowed: {sorted(ELEM_FORMATS)}")
    return ELEM_FORMATS[elem]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exp2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly 2**e for integer ``e``, built from the bit pattern (no libm exp2, no rounding).

    fp32: e in [-127, 127] (2**-127 is an fp32 subnormal); fp64: e in [-1022, 1023].
    """
    e = e.to(torch.int64)
    if dtype == torch.float64:
        return ((e + 1023) << 52).view(torch.float64)
    bits = torch.where(e >= -126, (e + 127) << 23, torch.full_like(e, 1 << 22))
    return bits.to(torch.int32).view(torch.float32)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for finite a > 0, exact (frexp gives a = m * 2**e with m in [0.5, 1))."""
    return torch.frexp(a).exponent.to(torch.int64) - 1


def _to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., n] -> [..., n / block_size, block_size]."""
    if x.dim() == 0 or x.shape[-1] % block_size != 0:
        raise ValueError(
            f"MX quantization needs the last dim divisible by block_size={block_size}; "
            f"got shape {tuple(x.shape)}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def _round_to_elem(v: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Round already-scaled values to the element grid: RNE incl. subnormals, saturate to +-max.

    The quantum of |v| is 2**(max(floor(log2|v|), emin) - mbits); dividing by it puts the
    representable values of that binade on the integers, where torch.round breaks ties to even,
    which is the even mantissa. Rounding up out of a binade lands on the next power of two, which
    is representable, so no renormalisation is needed.
    """
    mag = v.abs()
    e = torch.frexp(mag).exponent.to(torch.int64) - 1  # zero gives -1, clamped to emin below
    quantum = _exp2(e.clamp(min=fmt.emin) - fmt.mbits, v.dtype)
    q = torch.round(mag / quantum) * quantum
    return torch.copysign(q.clamp(max=fmt.max_normal), v)


def _mx_blocks(x: torch.Tensor, fmt: ElemFormat, block_size: int):
    """Shared core of quantize and fake-quant.

    x: [..., n]. Returns (p [..., n/bs, bs] element values in compute dtype,
    scale_exp [..., n/bs, 1] int64 unbiased exponent, nan_block [..., n/bs, 1] bool).
    """
    xb = _to_blocks(x, block_size).to(_compute_dtype(x.dtype))
    # NaN and Inf both make amax non-finite (amax of a NaN block is NaN): see module docstring.
    amax = xb.abs().amax(dim=-1, keepdim=True)
    nan_block = ~torch.isfinite(amax)
    # An all-zero block has no log2; use the minimum scale so its elements encode as exact zeros.
    safe = torch.where(nan_block | (amax == 0), torch.ones_like(amax), amax)
    scale_exp = _floor_log2(safe) - fmt.emax
    scale_exp = torch.where(amax == 0, torch.full_like(scale_exp, SCALE_EMIN), scale_exp)
    scale_exp = scale_exp.clamp(SCALE_EMIN, SCALE_EMAX)
    finite_x = torch.where(nan_block, torch.zeros_like(xb), xb)
    p = _round_to_elem(finite_x * _exp2(-scale_exp, xb.dtype), fmt)
    return p, scale_exp, nan_block


def fake_quant_mx(x: torch.Tensor, elem: str, block_size: int = 32) -> torch.Tensor:
    """Quantize to MX (``elem`` in {"e2m1", "e4m3"}, E8M0 scale per block) and dequantize.

    x: [..., n] with n % block_size == 0; blocks run along the last dim.
    Returns [..., n] in x.dtype; equal to ``dequantize_mx(*quantize_mx(x, elem, block_size),
    elem, block_size, x.dtype)`` bit for bit.
    """
    fmt = _elem_format(elem)
    p, scale_exp, nan_block = _mx_blocks(x, fmt, block_size)
    out = p * _exp2(scale_exp, p.dtype)
    out = torch.where(nan_block, torch.full_like(out, float("nan")), out)
    return out.reshape(x.shape).to(x.dtype)


def _encode_elem(p: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Element values already on the grid -> sign|exponent|mantissa codes (uint8 holding nbits)."""
    mag = p.abs()
    e = (torch.frexp(mag).exponent.to(torch.int64) - 1).clamp(min=fmt.emin)
    is_normal = mag >= 2.0**fmt.emin
    exp_field = torch.where(is_normal, e + fmt.bias, torch.zeros_like(e))
    # Normals: mag = (1 + m / 2**mbits) * 2**e; subnormals: mag = m * 2**(emin - mbits).
    frac = mag * _exp2(fmt.mbits - e, p.dtype)
    mant = torch.where(is_normal, frac - 2**fmt.mbits, frac).to(torch.int64)
    sign = torch.signbit(p).to(torch.int64)
    code = (sign << (fmt.nbits - 1)) | (exp_field << fmt.mbits) | mant
    return code.to(torch.uint8)


def elem_code_table(elem: str) -> torch.Tensor:
    """Value of each element code: fp32 [2**nbits]; NaN for E4M3's NaN codes 0x7F and 0xFF."""
    fmt = _elem_format(elem)
    codes = torch.arange(2**fmt.nbits, dtype=torch.int64)
    sign = codes >> (fmt.nbits - 1)
    exp_field = (codes >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mant = (codes & ((1 << fmt.mbits) - 1)).to(torch.float64)
    normal = (1 + mant / 2**fmt.mbits) * torch.exp2((exp_field - fmt.bias).to(torch.float64))
    subnormal = mant / 2**fmt.mbits * 2.0**fmt.emin
    mag = torch.where(exp_field > 0, normal, subnormal)
    vals = torch.where(sign == 1, -mag, mag)
    if fmt.has_nan:
        vals[(exp_field == (1 << fmt.ebits) - 1) & (mant == 2**fmt.mbits - 1)] = float("nan")
    return vals.to(torch.float32)


def quantize_mx(x: torch.Tensor, elem: str, block_size: int = 32):
    """Encode x as MX. x: [..., n].

    Returns (codes uint8 [..., n] holding the element bit pattern sign|exponent|mantissa in the
    low 4 (e2m1) or 8 (e4m3) bits, scale_exp uint8 [..., n / block_size] biased E8M0 byte, bias
    127, 255 = NaN). Codes of a NaN-scale block are 0: the scale alone makes the block NaN.
    """
    fmt = _elem_format(elem)
    p, scale_exp, nan_block = _mx_blocks(x, fmt, block_size)
    codes = torch.where(nan_block, torch.zeros_like(p), p)
    codes = _encode_elem(codes, fmt).reshape(x.shape)
    scale = torch.where(nan_block, torch.full_like(scale_exp, E8M0_NAN), scale_exp + E8M0_BIAS)
    return codes, scale.squeeze(-1).to(torch.uint8)


def dequantize_mx(
    codes: torch.Tensor,
    scale_exp: torch.Tensor,
    elem: str,
    block_size: int = 32,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode MX. codes: uint8 [..., n]; scale_exp: uint8 [..., n / block_size] -> [..., n]."""
    _elem_format(elem)
    compute = _compute_dtype(dtype)
    table = elem_code_table(elem).to(compute)
    p = _to_blocks(table[codes.to(torch.int64)], block_size)
    biased = scale_exp.to(torch.int64).unsqueeze(-1)
    if biased.shape[:-1] != p.shape[:-1]:
        raise ValueError(
            f"scale_exp shape {tuple(scale_exp.shape)} does not match codes shape "
            f"{tuple(codes.shape)} with block_size={block_size}"
        )
    # Clamp so 0xFF (NaN) still yields a valid exp2 argument; its blocks are overwritten below.
    out = p * _exp2((biased - E8M0_BIAS).clamp(SCALE_EMIN, SCALE_EMAX), compute)
    out = torch.where(biased == E8M0_NAN, torch.full_like(out, float("nan")), out)
    return out.reshape(codes.shape).to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte. codes: uint8 [..., n] (values < 16), n even -> uint8 [..., n/2].

    Element 2k goes in the low nibble of byte k and element 2k+1 in the high nibble, so the
    first element of a row sits in the least significant bits (little-endian nibble order).
    """
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_fp4 needs an even last dim; got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4. packed: uint8 [..., m] -> codes uint8 [..., 2m]."""
    lo = packed & 0x0F
    hi = (packed >> 4) & 0x0F
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
