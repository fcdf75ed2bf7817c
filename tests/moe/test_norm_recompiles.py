"""The compiled RMSNorm is not recompiled per autocast state (k3_mini's first step hit
Dynamo's recompile limit for ``rms_norm_eager`` because autocast state is a guard).

Run on CPU with Dynamo's ``eager`` backend: the guards and the graph count are Dynamo's, the
same on CUDA; the wrapper is the one ``moe.norm`` compiles with (``_RMS_NORM_COMPILE``)."""
import torch
from torch._dynamo.utils import counters

from moe import norm
from moe.compile import compile_for


def _graphs_after_calls(**compile_options) -> tuple[int, list]:
    """Call a fresh compiled rms_norm under autocast on and off, with the cast cache on and off
    (the CUDA-graphed step turns it off), for fp32 and bf16 inputs; return (graphs Dynamo
    compiled, [(got, want)] against the eager function)."""
    torch._dynamo.reset()
    counters.clear()
    fn = compile_for(norm.rms_norm_eager, device_types=("cpu",), backend="eager", **compile_options)
    w = torch.rand(16) + 0.5
    pairs = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 16, dtype=dtype)
        for autocast, cache in ((False, True), (True, True), (True, False), (False, False), (True, True)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=cache):
                out_dtype = norm.autocast_dtype(x) or x.dtype
                pairs.append((fn(x, w, 1e-6, out_dtype), norm.rms_norm_eager(x, w, 1e-6, out_dtype)))
    return counters["stats"]["unique_graphs"], pairs


def test_rms_norm_compiles_once_per_dtype_combination_not_per_autocast_state():
    options = dict(norm._RMS_NORM_COMPILE)
    assert options.pop("outside_autocast") is True
    graphs, pairs = _graphs_after_calls(outside_autocast=True, **options)
    # (x dtype, out dtype): (fp32, fp32), (fp32, bf16), (bf16, bf16): three graphs, none for
    # entering the same dtypes under the other autocast state.
    assert graphs == 3
    for got, want in pairs:
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_without_the_switch_autocast_state_is_a_guard():
    # The counter sees the difference: without it each (autocast, cache) state is a guard, and
    # every dtype combination compiles once per state it is entered in: fp32 -> fp32 in
    # (off, on), (off, off); fp32 -> bf16 in (on, on), (on, off); bf16 -> bf16 in all four.
    graphs, _ = _graphs_after_calls(outside_autocast=False, dynamic=True)
    assert graphs == 8


def test_rms_norm_modules_of_every_width_and_rank_share_graphs(monkeypatch):
    """RMSNorm modules of six widths (k3_mini's and K3's), inputs of rank 2 and 3, contiguous,
    a slice of a wider tensor (MLA normalises a slice of its down-projection), a view into a
    larger base and rows at an offset, in training and in evaluation (no grad): one graph per
    grad mode, whatever the width and layout, where passing the Parameter and the input as they
    are compiles one per width and rank and reaches Dynamo's limit of 8 (as k3_mini's first
    step did on an H200). Before the rows were made contiguous non-views it was 3 per grad mode
    (Dynamo guards a view on its base's layout: contiguous rows, a slice's strided rows, rows
    of another base; the H200 run of k3_mini at 97879a3 compiled those 6, and its evaluation
    then hit the limit, issue 40). Outputs and weight gradients equal the eager norm's bitwise."""
    fn = compile_for(norm.rms_norm_eager, device_types=("cpu",), backend="eager", **norm._RMS_NORM_COMPILE)

    def inputs(width):
        yield torch.randn(2, 3, width)
        yield torch.randn(5, width)
        yield torch.randn(2, 3, width + 64)[..., :width]
        yield torch.randn(2, 3, 2 * width).view(2, 3, 2, width)[:, :, 1]
        yield torch.randn(7, width)[2:]
        yield torch.randn(4, 1, width)

    def graphs(call) -> int:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                for width in (1024, 384, 256, 7168, 1536, 512):
                    mod = norm.RMSNorm(width)
                    mod.weight.data.uniform_(0.5, 1.5)
                    for x in inputs(width):
                        got, want = call(mod, x), norm.rms_norm_eager(x, mod.weight, mod.eps, x.dtype)
                        torch.testing.assert_close(got, want, rtol=0, atol=0)
                        if grad:
                            g_got, = torch.autograd.grad(got.square().sum(), mod.weight)
                            g_want, = torch.autograd.grad(want.square().sum(), mod.weight)
                            torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)
        return counters["stats"]["unique_graphs"]

    monkeypatch.setattr(norm, "_rms_norm", fn)
    assert graphs(lambda mod, x: mod(x)) == 2
    # The counter sees the difference: the Parameter and the input passed as they are.
    assert graphs(lambda mod, x: fn(x, mod.weight, mod.eps, x.dtype)) >= 8
