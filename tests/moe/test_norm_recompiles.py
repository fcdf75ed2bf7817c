"""The compiled RMSNorm is not recompiled per autocast state (issue 22: k3_mini's first step hit
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
