"""fp8 reaches the attention projections: the megatron-core linears (ColumnLinear/RowLinear at
tp=1) get torchao's float8 training matmul as their ``quant`` hook, and compute exactly what
torchao's own ``Float8Linear`` computes for an ``nn.Linear`` holding the same weight, forward
and both gradients. Run on CPU with torchao's float8 emulation (``emulate=True``: the same
scaling and E4M3/E5M2 rounding, the GEMM in high precision); skipped without torchao."""
import re

import pytest
import torch
from torch import nn

from k3train.config import load_config
from k3train.ops.layers import ColumnLinear, RowLinear
from k3train.model.model import build_model
from k3train.quant.fp8_grouped import Fp8GroupedGemm
from k3train.quant.recipes import DEFAULT_SCOPES, _apply_fp8, fp8_linear_config, select_scope
from moe import GroupedExperts

from tests.helpers import SMALL

float8 = pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from k3train.quant.fp8 import Float8Matmul, _float8_matmul_eager, float8_linear_class  # noqa: E402

# SMALL with every projection width a multiple of 16 (fp8 GEMMs need it): MLA's kv_down is
# kv_lora_rank + qk_rope_head_dim wide.
DIMS = [*SMALL, "model.mla.qk_rope_head_dim=16", "train.device=cpu"]


def _model():
    torch.manual_seed(0)
    return build_model(load_config("configs/k3_tiny.yaml", DIMS))


def test_default_fp8_scope_covers_the_attention_projections(world1):
    model = _model()
    chosen = select_scope(model, DEFAULT_SCOPES["fp8"])
    kda = [f"layers.0.mixer.{p}_proj" for p in "qkvgo"]
    mla = [f"layers.3.mixer.{p}" for p in ("q_down", "q_up", "kv_down", "kv_up", "gate_proj", "o_proj")]
    ffn = ["layers.1.ffn.down", "layers.1.ffn.up", "layers.1.ffn.shared.gate_proj"]
    assert set(kda + mla + ffn) <= set(chosen)
    assert "layers.1.ffn.experts" not in chosen   # only under precision.fp8_experts
    # Not the thin GEMMs (KDA's rank-128 forget gate, one-column-per-head beta) or the router.
    assert not [n for n in chosen if re.search(r"f_down|f_up|b_proj|router", n)]
    names_before = list(model.state_dict())
    tokens = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(1))
    want = model(tokens[:, :-1], tokens[:, 1:]).item()
    _apply_fp8(model, chosen, config=fp8_linear_config(emulate=True))
    modules = dict(model.named_modules())
    for name in chosen:
        mod = modules[name]
        if isinstance(mod, (ColumnLinear, RowLinear)):
            assert isinstance(mod.quant, Float8Matmul), name
        elif isinstance(mod, GroupedExperts):  # the emulated FP8 grouped GEMM (config.emulate)
            assert isinstance(mod.grouped_gemm, Fp8GroupedGemm) and mod.grouped_gemm.emulate, name
        else:  # torchao's module, with its product through k3train.quant.fp8.float8_matmul
            assert type(mod) is float8_linear_class() and isinstance(mod, Float8Linear), name
    assert list(model.state_dict()) == names_before  # checkpoints keep their layout
    # The whole model's loss moves by float8 rounding only (measured: ~1e-3 relative).
    got = model(tokens[:, :-1], tokens[:, 1:]).item()
    assert got != want and got == pytest.approx(want, rel=2e-2)
    hooks = {n: getattr(modules[n], "quant", getattr(modules[n], "grouped_gemm", None)) for n in chosen}
    _apply_fp8(model, chosen, config=fp8_linear_config(emulate=True))  # idempotent
    modules = dict(model.named_modules())
    assert {n: getattr(modules[n], "quant", getattr(modules[n], "grouped_gemm", None)) for n in chosen} == hooks
    assert all(type(modules[n]) in (float8_linear_class(), ColumnLinear, RowLinear, GroupedExperts)
               for n in chosen)


@pytest.mark.parametrize("cls", [ColumnLinear, RowLinear])
def test_tp_linear_fp8_equals_torchao_float8_linear(world1, cls):
    torch.manual_seed(0)
    config = fp8_linear_config(emulate=True)
    ours = cls(64, 48, std=0.05)
    ours.quant = Float8Matmul(config=config)
    ref_linear = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        ref_linear.weight.copy_(ours.inner.weight)
    ref = Float8Linear.from_float(ref_linear, config)
    x = torch.randn(2, 5, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)
    torch.testing.assert_close(ours.inner.weight.grad, ref.weight.grad, rtol=0, atol=0)
    # And it is float8, not the high-precision product: off by E4M3's rounding (2^-4 relative
    # per element; a few percent over the sum), not by 0.
    exact = x @ ours.inner.weight.detach().t()
    err = ((ya - exact).norm() / exact.norm()).item()
    assert 1e-4 < err < 0.08


def test_default_scope_skips_linears_fp8_cannot_run_an_explicit_scope_refuses(world1):
    """SMALL's MLA kv_down is 64 -> 40 (kv_lora 32 + shared key 8): not float8-shaped. The
    default scope leaves it in bf16 and converts the rest; a scope naming it is refused."""
    from k3train.errors import UsageError

    model = _model_small()
    chosen = select_scope(model, DEFAULT_SCOPES["fp8"])
    done = _apply_fp8(model, chosen, config=fp8_linear_config(emulate=True), skip_unfit=True)
    assert "layers.3.mixer.kv_down" in chosen and "layers.3.mixer.kv_down" not in done
    assert set(done) == set(chosen) - {"layers.3.mixer.kv_down"}
    assert type(model.get_submodule("layers.3.mixer.kv_down")) is nn.Linear
    with pytest.raises(UsageError, match=r"both dims of layers\.3\.mixer\.kv_down to be multiples of 16; got 64x40"):
        _apply_fp8(_model_small(), {"layers.3.mixer.kv_down": "layers.3.mixer.kv_down"},
                   config=fp8_linear_config(emulate=True))


def _model_small():
    torch.manual_seed(0)
    return build_model(load_config("configs/k3_tiny.yaml", [*SMALL, "train.device=cpu"]))


def test_converted_linear_computes_what_torchaos_float8linear_computes(world1):
    """The class ``_apply_fp8`` gives converted ``nn.Linear`` modules changes only where the
    product runs: forward, grad input and grad weight equal torchao's own Float8Linear's."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    config = fp8_linear_config(emulate=True)
    ref = Float8Linear.from_float(nn.Linear(64, 48, bias=True), config)
    ref.load_state_dict(lin.state_dict())
    ours = Float8Linear.from_float(lin, config)
    ours.__class__ = float8_linear_class()
    x = torch.randn(2, 16, 64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [m(xi) for m, xi in zip((ours, ref), xs)]
    g = torch.randn_like(ys[0])
    for y in ys:
        y.backward(g)
    assert torch.equal(ys[0], ys[1]) and torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(ours.weight.grad, ref.weight.grad) and torch.equal(ours.bias.grad, ref.bias.grad)


@pytest.mark.slow
def test_compiled_float8_matmul_equals_eager_with_one_graph_for_every_shape():
    """What ``float8_matmul`` runs on CUDA, compiled here for CPU tensors (Inductor's CPU
    backend, float8 emulated): the fused scaling gives the eager result exactly, forward and
    both gradients, and ``dynamic=True`` keeps one graph across the linears' shapes."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from moe.compile import compile_for

    torch._dynamo.reset()
    counters.clear()
    compiled = compile_for(_float8_matmul_eager, device_types=("cpu",), dynamic=True, outside_autocast=True)
    config = fp8_linear_config(emulate=True)
    with torch.device("meta"):
        shell = Float8Linear(16, 16, bias=False, config=config)
    torch.manual_seed(0)
    for rows, d_in, d_out in ((32, 64, 48), (48, 128, 64), (16, 64, 96)):
        x, w = torch.randn(2, rows, d_in), torch.randn(d_out, d_in)
        outs = []
        for fn in (compiled, _float8_matmul_eager):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fn(xi, wi.t(), shell.linear_mm_config, shell.config)
            y.backward(torch.ones_like(y) * 0.01 + y.detach() * 1e-3)
            outs.append((y.detach(), xi.grad, wi.grad))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    # one graph for three shapes (Dynamo's count of graphs it compiled)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_fp8_gemm_shapes_of_a_meta_model_are_what_conversion_converts(world1):
    """fp8_gemm_shapes on a model built on the meta device (what bench_te_linear does for the
    slice) against the modules _apply_fp8 converts on a real model of the same config; DIMS
    without the rope override leaves MLA's kv_down at a width that is not a multiple of 16,
    which the default scope skips."""
    from k3train.quant.recipes import fp8_gemm_shapes

    for dims in (DIMS, [d for d in DIMS if "qk_rope" not in d]):
        cfg = load_config("configs/k3_tiny.yaml", dims)  # built in bf16: fp8 itself refuses a CPU
        with torch.device("meta"):
            meta = build_model(cfg)
        got = fp8_gemm_shapes(meta, cfg.precision.model_copy(update={"recipe": "fp8"}))
        real = build_model(cfg)
        done = _apply_fp8(real, select_scope(real, DEFAULT_SCOPES["fp8"]), config=fp8_linear_config(emulate=True),
                          skip_unfit=True)
        linears = [n for n in done if not isinstance(real.get_submodule(n), GroupedExperts)]
        want: dict = {}
        for name in linears:
            out_f, in_f = real.get_submodule(name).weight.shape
            want[(in_f, out_f)] = want.get((in_f, out_f), 0) + 1
        assert got == want and sum(got.values()) == len(linears) > 0
