"""FP8 routed experts (k3train.quant.fp8_grouped): the emulated FP8 grouped GEMM against a naive
per-expert loop written here, its error against the full-precision product within the E4M3
bound derived below, the group padding the GPU kernel needs, the fp8 scope, and a tiny model
training under the emulated recipe. The GPU kernel is checked against this emulation by
scripts/gpu_check_fp8_experts.py.

The E4M3 bound. With a power-of-two scale ``s = 2**floor(log2(448 / amax))`` every scaled element
lies in [-448, 448] and ``s >= 224 / amax``. Rounding to nearest on E4M3's grid (3 mantissa bits)
moves a normal value (|a s| >= 2**-6) by at most 2**-4 of itself, and a subnormal one by at most
half the subnormal step, 2**-10 (in scaled units): so ``|q(a) - a| <= a_err = 2**-4 |a| +
2**-10 amax / 224`` for every element of a slice sharing one scale. A product of two quantised
operands then errs by at most ``a_err @ |b| + |a| @ b_err + a_err @ b_err``, elementwise, plus
fp32 accumulation (tested with a relative slack of 1e-5).
"""
import math

import pytest
import torch

from k3train.config import load_config
from k3train.config.schema import PrecisionConfig
from k3train.errors import UsageError
from k3train.model.model import build_model
from k3train.quant import fp8_grouped
from k3train.quant.fp8_grouped import EmulatedFp8GroupedMM, Fp8GroupedGemm, fake_quant_e4m3, pow2_scale
from k3train.quant.mx import elem_code_table
from k3train.quant.recipes import (DEFAULT_SCOPES, FP8_EXPERTS_SCOPE, _apply_fp8, _apply_mx, fp8_linear_config,
                                   scope_patterns, select_scope)
from k3train.quant.spec import MX_SPECS
from moe import GroupedExperts
from moe.group_pad import pad_groups

from tests.helpers import SMALL

COUNTS = [5, 0, 9, 3, 0, 7]  # uneven groups, empty ones, one at each end of the order too
K, N = 32, 24


def _naive_qdq(t: torch.Tensor, dim: int) -> torch.Tensor:
    """E4M3 fake-quant written independently: the scale from log2 in fp64, one per slice of ``dim``."""
    amax = t.abs().double().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    s = torch.exp2(torch.floor(torch.log2(448.0 / amax))).float()
    return (t.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s


def _naive_fp8_grouped(x, w, counts, dy):
    """(y, dx, dw) of the FP8 grouped GEMM as a per-expert loop of quantise, dequantise, matmul."""
    ys, dxs, dws, lo = [], [], [], 0
    for e, c in enumerate(counts):
        xe, dye = x[lo:lo + c], dy[lo:lo + c]
        ys.append(_naive_qdq(xe, 1) @ _naive_qdq(w[e], 0))        # x per row, w per column (over K)
        dxs.append(_naive_qdq(dye, 1) @ _naive_qdq(w[e], 1).T)    # dy per row, w per row (over N)
        # weight gradient: x and dy per column over this expert's rows only
        dws.append(_naive_qdq(xe, 0).T @ _naive_qdq(dye, 0) if c else torch.zeros(w.shape[1:]))
        lo += c
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def _inputs(seed=0, counts=COUNTS):
    gen = torch.Generator().manual_seed(seed)
    m = sum(counts)
    # Rows of very different magnitude, so per-row scales differ and some elements go subnormal.
    x = torch.randn(m, K, generator=gen) * torch.logspace(-3, 1, m)[:, None]
    # Magnitudes varying along K and N, so that scaling over the wrong dim changes the scales.
    w = torch.randn(len(counts), K, N, generator=gen) * torch.logspace(-2, 0, K)[:, None] * torch.logspace(0, -2, N)
    dy = torch.randn(m, N, generator=gen) * torch.logspace(-1, 1, N) * torch.logspace(-2, 1, m)[:, None]
    return x, w, dy


def _run(gemm, x, w, counts, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemm(x, w, torch.cumsum(torch.tensor(counts), 0, dtype=torch.int32))
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_pow2_scale_is_the_largest_power_of_two_keeping_amax_within_448():
    amax = torch.tensor([448.0, 1.0, 3.5, 449.0, 0.0, 1e-30, 2.0**-20])
    s = pow2_scale(amax)
    assert torch.equal(torch.log2(s), torch.floor(torch.log2(s)))  # powers of two
    finite = amax > 0
    assert (amax * s <= 448)[finite].all() and (amax * s * 2 > 448)[finite & (amax > 1e-12)].all()
    assert s[0] == 1 and s[1] == 256 and s[3] == 0.5


def test_e4m3_rounding_is_nearest_on_the_e4m3_grid():
    """Scale 1 (amax 448): every fake-quantised value is an E4M3 value (MX's independent code
    table) and the nearest one; ties (1.0625 between 1 and 1.125) go to the even mantissa."""
    grid = elem_code_table("e4m3")
    grid = grid[torch.isfinite(grid)].unique()
    t = torch.cat([torch.tensor([448.0, 1.0625, 1.1875, -3.3, 2.0**-9, 3 * 2.0**-10]),
                   torch.empty(200).uniform_(-448, 448)])
    q = fake_quant_e4m3(t[None], dim=1)[0]
    nearest = grid[(t[:, None] - grid[None]).abs().argmin(1)]
    assert torch.isin(q, grid).all()
    assert ((q - t).abs() <= (nearest - t).abs()).all()
    assert q[1] == 1.0 and q[2] == 1.25 and q[4] == 2.0**-9 and q[5] == 2 * 2.0**-9


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 6], [4]])
def test_emulated_fp8_grouped_gemm_equals_the_naive_per_expert_loop(counts):
    x, w, dy = _inputs(counts=counts)
    got = _run(Fp8GroupedGemm(emulate=True), x, w, counts, dy)
    want = _naive_fp8_grouped(x, w, counts, dy)
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        # The same quantised operands and the same fp32 products, expert by expert: bitwise.
        assert torch.equal(g, r), name
    assert got[2][[e for e, c in enumerate(counts) if c == 0]].abs().sum() == 0  # empty experts: no gradient


def _bound(a: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor, b_amax: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |q(a) @ q(b) - a @ b| (module docstring); amaxes broadcast like a, b."""
    a_err = a.abs() / 16 + 2.0**-10 * a_amax / 224
    b_err = b.abs() / 16 + 2.0**-10 * b_amax / 224
    return a_err @ b.abs() + a.abs() @ b_err + a_err @ b_err


def test_fp8_grouped_error_against_the_fp32_product_is_within_the_e4m3_bound():
    x, w, dy = _inputs(seed=1)
    y, dx, dw = _run(Fp8GroupedGemm(emulate=True), x, w, COUNTS, dy)
    lo, rel = 0, []
    for e, c in enumerate(COUNTS):
        xe, dye, we = x[lo:lo + c], dy[lo:lo + c], w[e]
        checks = [  # (fp8 result, fp32 product, its bound)
            (y[lo:lo + c], xe @ we, _bound(xe, xe.abs().amax(1, keepdim=True), we, we.abs().amax(0, keepdim=True))),
            (dx[lo:lo + c], dye @ we.T,
             _bound(dye, dye.abs().amax(1, keepdim=True), we.T, we.T.abs().amax(0, keepdim=True))),
            (dw[e], xe.T @ dye, _bound(xe.T, xe.T.abs().amax(1, keepdim=True) if c else xe.T,
                                       dye, dye.abs().amax(0, keepdim=True) if c else dye)),
        ]
        for got, exact, bound in checks:
            assert ((got - exact).abs() <= bound * (1 + 1e-5) + 1e-30).all()
            if exact.numel():
                rel.append(((got - exact).norm() / exact.norm()).item())
        lo += c
    # Quantisation did happen, and is of E4M3's size: a few percent, not more than 2 x 2^-4.
    assert min(rel) > 1e-3 and max(rel) < 2 * 2.0**-4


def test_padding_groups_to_16_rows_changes_nothing():
    """The GPU kernel's groups are padded to 16 rows (moe.group_pad) inside GroupedExperts; with
    the emulation asked to pad too, output and gradients are bitwise those of the unpadded run
    (padding rows are zeros: no amax, no scale, no product changes)."""
    counts = torch.tensor([5, 0, 17, 3])
    x = torch.randn(int(counts.sum()), K)
    xp, offs, rows = pad_groups(x, counts, 16)
    # Every group a positive multiple of 16 rows (the empty one too), the buffer a multiple of 16.
    assert offs.tolist() == [16, 32, 64, 80] and xp.shape[0] == 32 + 4 * 16
    assert torch.equal(xp[rows], x) and xp.abs().sum() == x.abs().sum()
    results = []
    for align in (1, 16):
        torch.manual_seed(0)
        experts = GroupedExperts(4, K, N, init_std=0.1)
        experts.grouped_gemm = Fp8GroupedGemm(emulate=True)
        experts.grouped_gemm.group_alignment = align
        xin = x.clone().requires_grad_()
        y = experts(xin, counts)
        y.backward(torch.ones_like(y))
        results.append([y, xin.grad, experts.w_gate.grad, experts.w_up.grad, experts.w_down.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


# fp8's default scope with precision.fp8_experts=true.
FP8_WITH_EXPERTS = [*DEFAULT_SCOPES["fp8"], FP8_EXPERTS_SCOPE]


def _model(*extra):
    torch.manual_seed(0)
    return build_model(load_config("configs/k3_tiny.yaml", [*SMALL, "model.mla.qk_rope_head_dim=16",
                                                            "train.device=cpu", *extra]))


def test_fp8_experts_field_adds_the_experts_to_the_default_scope():
    """precision.fp8_experts (default off) puts the routed experts in fp8's default scope; an
    explicit scope is taken as given."""

    assert FP8_EXPERTS_SCOPE not in scope_patterns(PrecisionConfig(recipe="fp8"))
    assert scope_patterns(PrecisionConfig(recipe="fp8", fp8_experts=True)) == FP8_WITH_EXPERTS
    assert scope_patterns(PrecisionConfig(recipe="fp8", fp8_experts=True, scope=["^head$"])) == ["^head$"]
    assert scope_patterns(PrecisionConfig(recipe="mxfp8", fp8_experts=True)) == DEFAULT_SCOPES["mxfp8"]


def test_fp8_scope_selects_the_routed_experts_and_never_the_router(world1):
    model = _model()
    experts = [n for n, m in model.named_modules() if isinstance(m, GroupedExperts)]
    routers = [n for n, _ in model.named_modules() if n.endswith("router")]
    chosen = select_scope(model, FP8_WITH_EXPERTS)
    assert experts and routers and set(experts) <= set(chosen)
    assert not [n for n in chosen for r in routers if n == r or n.startswith(r + ".")]
    names = list(model.state_dict())  # megatron's linears add non-tensor extra state
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    _apply_fp8(model, chosen, config=fp8_linear_config(emulate=True))
    for name in experts:
        gemm = model.get_submodule(name).grouped_gemm
        assert isinstance(gemm, Fp8GroupedGemm) and gemm.emulate
    # A checkpoint keeps the same tensors: names, shapes, dtypes and values (fp8 only in the GEMM).
    after = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert list(after) == list(before) and list(model.state_dict()) == names
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    # The MX recipes are untouched: experts get MX hooks and no grouped GEMM.
    assert DEFAULT_SCOPES["mxfp8"] == DEFAULT_SCOPES["mxfp4_qat"] == [r"\.ffn\.experts$"]
    mx = _model()
    _apply_mx(mx, experts[0], experts[0], MX_SPECS["mxfp8"])
    assert mx.get_submodule(experts[0]).grouped_gemm is None


def test_a_tiny_model_trains_under_the_emulated_fp8_recipe(world1, monkeypatch):
    """Every expert GEMM goes through the emulated FP8 grouped GEMM, the model learns a fixed
    batch, and its losses follow the unquantised model's within float8 rounding."""
    tokens = torch.randint(0, 320, (4, 33), generator=torch.Generator().manual_seed(1))
    calls = []
    real_call = Fp8GroupedGemm.__call__
    monkeypatch.setattr(Fp8GroupedGemm, "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))
    curves = []
    for fp8 in (False, True):
        model = _model()
        if fp8:
            _apply_fp8(model, select_scope(model, FP8_WITH_EXPERTS), config=fp8_linear_config(emulate=True))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    n_experts = sum(isinstance(m, GroupedExperts) for m in model.modules())
    assert len(calls) == 8 * 3 * n_experts  # three grouped GEMMs per expert block per step
    ref, got = curves
    assert all(math.isfinite(v) for v in got) and got[-1] < got[0] - 1.0
    # Step 1 is the same weights (float8 rounding only: measured 7e-4 relative); later steps
    # drift (measured up to 3e-3 over 8 steps), within 1%.
    assert got[0] != ref[0] and got[0] == pytest.approx(ref[0], rel=2e-3)
    assert all(g == pytest.approx(r, rel=1e-2) for g, r in zip(got, ref))


def test_the_kernel_path_hands_torchao_what_its_layout_rules_ask(monkeypatch):
    """The CUDA path on CPU with torchao's kernel replaced by a stand-in that checks its inputs
    (x row-major, K a multiple of 16; the weight column-major [G, K, N] in x's dtype; every
    group a positive multiple of 16 rows; autocast off; torchao's padding off) and computes the
    emulation: the experts under bf16 autocast then equal the emulated path."""
    seen = []

    def kernel(x, w_t, offs, *, out_dtype, pad_token_groups_for_grouped_mm):
        assert x.stride(1) == 1 and x.shape[1] % 16 == 0 and x.shape[0] % 16 == 0
        assert w_t.dtype == x.dtype and out_dtype == torch.bfloat16  # torch's only grouped fp8 output
        assert w_t.stride(1) == 1 and w_t.stride(2) == w_t.shape[1]
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        assert (sizes > 0).all() and (sizes % 16 == 0).all() and offs.dtype == torch.int32
        assert not torch.is_autocast_enabled("cpu") and pad_token_groups_for_grouped_mm is False
        seen.append(tuple(w_t.shape))
        return EmulatedFp8GroupedMM.apply(x, w_t, offs)

    monkeypatch.setattr(fp8_grouped, "_torchao_kernel", lambda: kernel)
    F = 48  # the kernel's widths are multiples of 16
    counts = torch.tensor([5, 0, 17, 3])
    x = torch.randn(int(counts.sum()), K)
    results = []
    for emulate in (True, False):
        torch.manual_seed(0)
        experts = GroupedExperts(4, K, F, init_std=0.1, grouped_gemm=Fp8GroupedGemm(emulate=emulate))
        xin = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = experts(xin, counts)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        results.append([y, xin.grad, experts.w_gate.grad, experts.w_down.grad])
    assert seen == [(4, K, F), (4, K, F), (4, F, K)]
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_experts_whose_widths_the_kernel_cannot_take_are_refused_or_left_out():
    """An explicit scope naming experts of width 24 (not a multiple of 16) is one clear error;
    the default scope leaves them in bf16 (a small model's odd width is not an error)."""
    model = torch.nn.Module()
    model.ffn = torch.nn.Module()
    model.ffn.experts = GroupedExperts(2, 24, 32)
    targets = select_scope(model, [r"\.?ffn\.experts$"])
    with pytest.raises(UsageError, match=r"ffn\.experts.*multiples of 16.*in 24, ffn 32"):
        _apply_fp8(model, targets, config=fp8_linear_config(emulate=True))
    assert _apply_fp8(model, targets, config=fp8_linear_config(emulate=True), skip_unfit=True) == []
    assert model.ffn.experts.grouped_gemm is None
