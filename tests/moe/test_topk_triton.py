"""The router's Triton top-k (``moe/topk_triton.py``), run by Triton's CPU interpreter, against
a stable descending sort of ``scores + bias``: the same values bit for bit and the same indices,
ties going to the lowest column and NaN ranking above +inf (torch's order).

The GPU run is checked by ``scripts/gpu_check.py`` against ``torch.topk`` on CUDA, and at the
real router sizes by ``benchmarks/bench_quantile.py`` (its ``check`` rows).
"""
from __future__ import annotations

import pytest
import torch

from moe.topk import row_topk
from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

# Run in a child process with the interpreter on (tests/triton_interpreter.py); it saves
# its results for the checks here.
_CHILD = """
import sys, torch
from moe.topk_triton import row_topk_triton
cases, path = eval(sys.argv[1]), sys.argv[2]
out = {}
for case in cases:
    scores, bias = _inputs(*case)
    out[case] = row_topk_triton(scores, case[2], bias)
for bad in ((torch.randn(4, 8), 9), (torch.randn(4, 8).t(), 2), (torch.randn(4, 64), 33),
            (torch.randn(4, 1025), 4)):
    try:
        row_topk_triton(*bad)
    except ValueError as e:
        out.setdefault("errors", []).append(str(e))
# compile_ahead's dry run: launches compile but do not run; the indices must still be valid.
import moe.topk_triton as mod
mod._row_topk_kernel = type("NoLaunch", (), {"__getitem__": lambda self, grid: lambda *a, **k: None})()
out["dry_run_indices"] = mod.row_topk_triton(torch.rand(40, 64), 4)[1]
torch.save(out, path)
"""


def _inputs(n: int, e: int, k: int, dtype: str, bias: bool, special: bool):
    """scores ``[n, e]`` in ``dtype`` (bf16 scores are coarse, so they tie often) and an fp32
    bias or None; ``special`` plants exact ties, +-inf and NaN in the first rows."""
    gen = torch.Generator().manual_seed(n * 131 + e * 7 + k)
    scores = torch.rand(n, e, generator=gen).to(getattr(torch, dtype))
    if special:
        scores[0] = 0.5                                  # all tied: columns 0..k-1
        scores[1, ::3] = float("-inf")
        scores[2, 1] = float("nan")
        scores[2, 4] = float("inf")
        scores[3] = float("-inf")                        # k distinct picks from a row of -inf
        scores[4] = 0.0
        scores[4, ::2] = -0.0                            # -0.0 ties with +0.0: lowest column
    b = torch.randn(e, generator=gen) * 0.1 if bias else None
    if special and b is not None:
        b = -b.abs()                                     # keep row 0's tie on top:
        b[: e // 2] = 0.0                                # unbiased columns 0..k-1 win it
    return scores, b


# E not a power of two (padding columns), N not a multiple of the row block, k = 1 to 16, and
# K3's router: 896 experts top-16 (4 rows of 1024 columns per program).
CASES = [(300, 64, 4, "float32", True, True), (300, 64, 5, "bfloat16", True, True),
         (97, 10, 3, "float32", False, True), (70, 70, 16, "float16", True, False),
         (5, 64, 1, "float32", True, False), (41, 896, 16, "bfloat16", True, True)]
# The other router sizes of real MoE models: Quantile Balancing's top-17 at K3, 384 and 256
# experts top-8 and top-9, and the limits (1024 columns, k = 32).
REAL_SIZES = [(41, 896, 17, "float32", True, False), (30, 384, 8, "bfloat16", True, True),
              (30, 384, 9, "float32", False, True), (30, 256, 8, "bfloat16", True, False),
              (30, 256, 9, "float32", True, True), (9, 1024, 32, "float32", True, False)]


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    return run_interpreted(tmp_path_factory.mktemp("topk"), _inputs, _CHILD, CASES)


@pytest.fixture(scope="module")
def real_size_results(tmp_path_factory):
    return run_interpreted(tmp_path_factory.mktemp("topk_sizes"), _inputs, _CHILD, REAL_SIZES)


def _check_against_stable_sort(results, case):
    values, indices = results[case]
    scores, bias = _inputs(*case)
    keyed = scores if bias is None else scores + bias
    ref_v, ref_i = torch.sort(keyed, dim=-1, descending=True, stable=True)
    k = case[2]
    assert values.dtype == keyed.dtype and indices.dtype == torch.int64
    torch.testing.assert_close(values, ref_v[:, :k], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(indices, ref_i[:, :k])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}E{}k{}-{}".format(*c[:4]))
def test_matches_stable_descending_sort(kernel_results, case):
    _check_against_stable_sort(kernel_results, case)


@pytest.mark.slow  # one more interpreted child, ~15 s on a shared 2-core machine
@pytest.mark.parametrize("case", REAL_SIZES, ids=lambda c: "N{}E{}k{}-{}".format(*c[:4]))
def test_real_router_sizes_match_stable_descending_sort(real_size_results, case):
    _check_against_stable_sort(real_size_results, case)


def test_special_rows_follow_torch_order(kernel_results):
    values, indices = kernel_results[CASES[0]]
    assert indices[0].tolist() == [0, 1, 2, 3]          # ties: lowest column first
    assert torch.isnan(values[2, 0]) and indices[2, 0] == 1 and indices[2, 1] == 4
    assert indices[3].unique().numel() == 4             # a row of -inf: 4 distinct columns


def test_signed_zeros_tie_and_keep_their_sign(kernel_results):
    """Row 4 alternates -0.0 and +0.0 (no bias): torch.topk's order ties them, so the lowest
    columns win; the values come back with their own sign bits."""
    values, indices = kernel_results[CASES[2]]
    assert indices[4].tolist() == [0, 1, 2]
    assert torch.signbit(values[4]).tolist() == [True, False, True]


def test_bad_shapes_are_named(kernel_results):
    too_many, strided, over_max_k, too_wide = kernel_results["errors"]
    assert "k=9" in too_many and "E=8" in too_many
    assert "unit column stride" in strided
    assert "k=33" in over_max_k and "32" in over_max_k
    assert "E <= 1024" in too_wide


def test_dry_run_leaves_valid_indices(kernel_results):
    """k3train.ops.triton_compile.compile_ahead skips launches; gathers then still stay in range
    (empty indices made the first k3_mini dry run on an H200 fail a device-side assert)."""
    idx = kernel_results["dry_run_indices"]
    assert idx.shape == (40, 4) and bool(((idx >= 0) & (idx < 64)).all())


def test_cpu_dispatch_is_torch_topk():
    scores, bias = torch.rand(50, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    values, indices = row_topk(scores, 4, bias)
    ref = torch.topk(scores + bias, 4, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)
    with pytest.raises(ValueError, match="k=65"):
        row_topk(scores, 65)
