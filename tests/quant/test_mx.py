"""OCP MX v1.0 emulation: hand-computed spec cases plus an independent brute-force oracle."""

import math

import pytest
import torch

from k3train.quant.mx import dequantize_mx, fake_quant_mx, pack_fp4, quantize_mx, unpack_fp4
from k3train.quant.qat import MXFakeQuant, mx_qat_linear, quantized_grouped_weight

# (ebits, mbits, bias, emax) written out again here so the oracle does not share mx.py's tables.
SPECS = {"e2m1": (2, 1, 1, 2), "e4m3": (4, 3, 7, 8)}
ELEMS = list(SPECS)


def block(vals, n=32, dtype=torch.float32):
    """One block of n elements: vals followed by zeros. -> [1, n]."""
    return torch.tensor(list(vals) + [0.0] * (n - len(vals)), dtype=dtype).unsqueeze(0)


def exact(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def oracle_magnitudes(elem):
    """Every finite non-negative value of the element format, with its code, from the bit layout."""
    ebits, mbits, bias, _ = SPECS[elem]
    out = []
    for e_field in range(2**ebits):
        for m in range(2**mbits):
            if elem == "e4m3" and e_field == 15 and m == 7:
                continue  # S.1111.111 is NaN in OCP E4M3; there is no Inf
            if e_field == 0:
                v = m / 2**mbits * 2.0 ** (1 - bias)
            else:
                v = (1 + m / 2**mbits) * 2.0 ** (e_field - bias)
            out.append((v, (e_field << mbits) | m))
    return out


def oracle_fake_quant(x, elem, bs=32):
    """Brute force: E8M0 scale from math.frexp, then the nearest representable value by search.

    Ties go to the candidate with the even mantissa (code LSB 0). x: [R, n] float64.
    """
    ebits, mbits, _, emax = SPECS[elem]
    table = oracle_magnitudes(elem)
    cand = torch.tensor([v for v, _ in table], dtype=torch.float64)
    cand_codes = torch.tensor([c for _, c in table])
    out = torch.empty_like(x)
    codes = torch.empty(x.shape, dtype=torch.int64)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // bs):
            xb = x[r, b * bs:(b + 1) * bs]
            amax = xb.abs().max().item()
            e = -127 if amax == 0 else math.frexp(amax)[1] - 1 - emax
            scale = 2.0 ** max(-127, min(127, e))
            v = xb / scale
            dist = (v.abs().unsqueeze(-1) - cand).abs()  # [bs, K]
            tie = dist == dist.min(dim=-1, keepdim=True).values
            # Among the nearest candidates prefer an even mantissa (never more than two tie).
            pick = (tie & (cand_codes % 2 == 0)).any(-1, keepdim=True)
            chosen = torch.where(pick, tie & (cand_codes % 2 == 0), tie).float().argmax(-1)
            out[r, b * bs:(b + 1) * bs] = torch.copysign(cand[chosen], v) * scale
            sign = torch.signbit(v).long() << (ebits + mbits)
            codes[r, b * bs:(b + 1) * bs] = cand_codes[chosen] | sign
    return out, codes


def random_blocks(rows, n, seed, bs=32):
    """Gaussian blocks whose magnitudes range over 2**-30 .. 2**30, one scale per block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n // bs, bs, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, (rows, n // bs, 1), generator=g).double())
    return x.reshape(rows, n).float()


def tie_blocks(elem, rows, seed, bs=32):
    """Blocks of exact midpoints between neighbouring element values (every element is a tie),
    with the block max pinned to the format max so the scale is 2**k."""
    g = torch.Generator().manual_seed(seed)
    mags = sorted(v for v, _ in oracle_magnitudes(elem))
    mids = torch.tensor([(a + b) / 2 for a, b in zip(mags, mags[1:])], dtype=torch.float64)
    idx = torch.randint(0, len(mids), (rows, bs), generator=g)
    sign = torch.where(torch.rand(rows, bs, generator=g) < 0.5, -1.0, 1.0).double()
    x = mids[idx] * sign
    x[:, 0] = mags[-1]
    k = torch.randint(-20, 20, (rows, 1), generator=g).double()
    return (x * torch.exp2(k)).float()


def test_e2m1_hand_cases_rne():
    # amax 6.0 -> floor(log2 6) - 2 = 0 -> X = 1. Ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    # 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (even mantissa); 2.75 -> 3, 5.5 -> 6 by distance.
    x = block([0.25, 0.5, 0.75, 1.0, 1.25, 1.75, 2.5, 2.75, 3.5, 5.0, 5.5, 6.0, -1.25, -3.5, -0.3])
    want = block([0.0, 0.5, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0, -0.5])
    exact(fake_quant_mx(x, "e2m1"), want)
    codes, scale = quantize_mx(x, "e2m1")
    assert scale.tolist() == [[127]]
    assert codes[0, :15].tolist() == [0, 1, 2, 2, 2, 4, 4, 5, 6, 6, 7, 7, 0xA, 0xE, 0x9]


def test_e2m1_representable_magnitudes_are_fixed_points():
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert sorted(v for v, _ in oracle_magnitudes("e2m1")) == mags
    x = block(mags + [-m for m in mags])
    exact(fake_quant_mx(x, "e2m1"), x)
    # Same grid one binade lower: amax 0.75 -> X = 2**(-1 - 2) = 1/8.
    x = block([0.75, 0.7, 0.3, 0.03, 0.0313])
    exact(fake_quant_mx(x, "e2m1"), block([0.75, 0.75, 0.25, 0.0, 0.0625]))


def test_e4m3_subnormals_rne_and_saturation():
    s = 2.0**-9  # smallest E4M3 subnormal; with amax in [256, 512) the scale is X = 1
    x = block([448.0, s, 7 * s, 1.5 * s, 0.5 * s, 0.6 * s, 1 + 1 / 16, 1 + 3 / 16, 2.5 * s, 300.0])
    want = block([448.0, s, 7 * s, 2 * s, 0.0, s, 1.0, 1.25, 2 * s, 288.0])
    exact(fake_quant_mx(x, "e4m3"), want)
    codes, scale = quantize_mx(x, "e4m3")
    assert scale.tolist() == [[127]]
    assert codes[0, :3].tolist() == [0x7E, 0x01, 0x07]
    # Above 448 (same binade, X = 1) everything saturates to 448, never to the NaN code.
    x = block([464.0, 470.0, -500.0, 511.0])
    exact(fake_quant_mx(x, "e4m3"), block([448.0, 448.0, -448.0, 448.0]))
    assert quantize_mx(x, "e4m3")[0][0, :4].tolist() == [0x7E, 0x7E, 0xFE, 0x7E]


def test_e2m1_saturates_top_of_binade():
    # amax 7.9 -> X = 2**(2 - 2) = 1, 7.9 / X > 6 -> clamps to 6 (the spec's floor-based scale).
    exact(fake_quant_mx(block([7.9, -7.0, 3.3]), "e2m1"), block([6.0, -6.0, 3.0]))


def test_all_zero_block():
    x = torch.zeros(2, 64)
    codes, scale = quantize_mx(x, "e2m1")
    assert scale.eq(0).all() and codes.eq(0).all()  # minimum scale 2**-127, no NaN
    exact(fake_quant_mx(x, "e4m3"), x)


def test_outlier_crushes_small_values():
    # amax 1000 -> floor(log2) = 9 -> X = 2**7 = 128; element 0.25 * X = 32 is the tie point.
    x = block([1000.0, 1.0, 10.0, 31.9, 32.0, 33.0, 100.0, -200.0, -32.0, 500.0])
    want = block([768.0, 0.0, 0.0, 0.0, 0.0, 64.0, 128.0, -192.0, 0.0, 512.0])
    exact(fake_quant_mx(x, "e2m1"), want)
    # E4M3, same amax: X = 2**(9 - 8) = 2; smallest value 2**-9 * X; 2**-10 * X is a tie -> 0.
    y = block([1000.0, 2.0**-9, 2.0**-9 * 1.01, 1.0])
    exact(fake_quant_mx(y, "e4m3"), block([896.0, 0.0, 2.0**-8, 1.0]))  # 500 -> 448


def test_scale_clamped_high_saturates_float64():
    # floor(log2 2**200) - 2 = 198 is clamped to 127: elements 2**73 saturate to 6.
    x = block([2.0**200, -(2.0**199), 2.0**124, 1.0], dtype=torch.float64)
    out = fake_quant_mx(x, "e2m1")
    assert out.dtype == torch.float64
    exact(out, block([6 * 2.0**127, -6 * 2.0**127, 0.0, 0.0], dtype=torch.float64))
    assert quantize_mx(x, "e2m1")[1].tolist() == [[254]]


def test_scale_clamped_low():
    # floor(log2 2**-130) - emax is below -127: X = 2**-127 (an fp32 subnormal).
    x = block([2.0**-130, 2.0**-131, 2.0**-140])
    exact(fake_quant_mx(x, "e2m1"), torch.zeros_like(x))  # 2**-3, 2**-4 < 0.25 -> 0
    exact(fake_quant_mx(x, "e4m3"), block([2.0**-130, 2.0**-131, 0.0]))
    assert quantize_mx(x, "e4m3")[1].tolist() == [[0]]


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"]
)
def test_non_finite_block_is_nan(elem, bad):
    x = torch.ones(2, 64)
    x[0, 40] = bad
    out = fake_quant_mx(x, elem)
    assert out[0, 32:].isnan().all()
    assert not out[0, :32].isnan().any() and not out[1].isnan().any()
    codes, scale = quantize_mx(x, elem)
    ones = 127 - SPECS[elem][3]  # amax 1 -> X = 2**-emax
    assert scale.tolist() == [[ones, 255], [ones, ones]]
    exact(dequantize_mx(codes, scale, elem, 32, torch.float32), out)


@pytest.mark.parametrize("elem", ELEMS)
def test_brute_force_oracle(elem):
    x = torch.cat([random_blocks(24, 256, seed=1), tie_blocks(elem, 64, seed=2).reshape(8, 256)])
    want, want_codes = oracle_fake_quant(x.double(), elem)
    exact(fake_quant_mx(x, elem), want.float())
    codes, _ = quantize_mx(x, elem)
    assert torch.equal(codes.long(), want_codes)


@pytest.mark.parametrize("elem", ELEMS)
def test_idempotent(elem):
    x = torch.cat([random_blocks(16, 256, seed=3), tie_blocks(elem, 128, seed=4).reshape(16, 256)])
    q = fake_quant_mx(x, elem)
    exact(fake_quant_mx(q, elem), q)


@pytest.mark.parametrize("elem", ELEMS)
def test_error_within_half_ulp(elem):
    _, mbits, bias, _ = SPECS[elem]
    x = random_blocks(32, 256, seed=5)
    q = fake_quant_mx(x, elem).double()
    scale = torch.exp2(quantize_mx(x, elem)[1].double() - 127).repeat_interleave(32, dim=-1)
    v = x.double() / scale
    max_normal = max(m for m, _ in oracle_magnitudes(elem))
    inside = v.abs() <= max_normal  # saturated values have no half-ulp bound
    ulp = torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(1e-300))).clamp_min(1 - bias) - mbits)
    err = (x.double() - q).abs()
    assert inside.float().mean() > 0.9
    assert (err[inside] <= 0.5 * ulp[inside] * scale[inside]).all()


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_quantize_dequantize_equals_fake_quant(elem, dtype):
    x = random_blocks(8, 128, seed=6).to(dtype)
    x[3, 70] = float("nan")
    codes, scale = quantize_mx(x, elem, block_size=16)
    assert codes.dtype == scale.dtype == torch.uint8
    assert codes.shape == x.shape and scale.shape == (8, 8)
    exact(dequantize_mx(codes, scale, elem, 16, dtype), fake_quant_mx(x, elem, block_size=16))


def test_bf16_keeps_dtype():
    x = random_blocks(4, 64, seed=7).bfloat16()
    for elem in ELEMS:
        out = fake_quant_mx(x, elem)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        exact(out, fake_quant_mx(x.float(), elem).bfloat16())


def test_pack_unpack_fp4():
    assert pack_fp4(torch.tensor([0x1, 0x2, 0xF, 0x0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    codes = quantize_mx(random_blocks(3, 64, seed=8), "e2m1")[0]
    packed = pack_fp4(codes)
    assert packed.shape == (3, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_errors_name_shape_and_formats():
    with pytest.raises(ValueError, match=r"block_size=32.*\(4, 30\)"):
        fake_quant_mx(torch.zeros(4, 30), "e2m1")
    with pytest.raises(ValueError, match="e2m1.*e4m3"):
        fake_quant_mx(torch.zeros(4, 32), "e5m2")


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)], ids=["2d", "3d"])
def test_qat_linear_ste_gradients(shape):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(16, 64, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    y = mx_qat_linear(x, w, b)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    qx, qw = fake_quant_mx(x.detach(), "e4m3"), fake_quant_mx(w.detach(), "e2m1")
    torch.testing.assert_close(y, qx @ qw.T + b)
    torch.testing.assert_close(x.grad, dy @ qw)
    torch.testing.assert_close(w.grad, dy.reshape(-1, 16).T @ qx.reshape(-1, 64))
    torch.testing.assert_close(b.grad, dy.reshape(-1, 16).sum(0))


def test_ste_passes_saturated_gradient():
    x = block([100.0, 1.0, 0.01]).requires_grad_()
    MXFakeQuant.apply(x, "e2m1", 32).sum().backward()
    exact(x.grad, torch.ones_like(x))


def test_grouped_weight_blocks_run_along_reduction_dim():
    w = random_blocks(3 * 64, 32, seed=10).reshape(3, 64, 32).requires_grad_()  # [E, in, out]
    q = quantized_grouped_weight(w, layout="in_out")
    want = torch.stack([fake_quant_mx(w[e].detach().T, "e2m1").T for e in range(3)])
    exact(q, want)
    q.sum().backward()
    exact(w.grad, torch.ones_like(w))
    w2 = w.detach().transpose(1, 2).contiguous()  # [E, out, in]
    exact(quantized_grouped_weight(w2, layout="out_in"), want.transpose(1, 2))
    with pytest.raises(ValueError, match="in_out"):
        quantized_grouped_weight(w2, layout="rows")
