"""The capacity benchmark's search (benchmarks/capacity_search.py), against a fake out-of-memory threshold and a fake clock.

The GPU part (real steps, real memory) runs on an H200; here the logic that decides which
lengths are tried, which is the longest, and what the budget skips is checked against answers
worked out by hand.
"""
from __future__ import annotations

import json

import pytest

from benchmarks.bench_capacity import main
from benchmarks.capacity_search import doubling_lengths, longest, loglog_slope, predict_seconds, search_lengths


class FakeGPU:
    """OOM above ``limit`` tokens; each try advances the clock by ``a T + b T^2`` seconds."""

    def __init__(self, limit: int, a: float = 1e-3, b: float = 0.0):
        self.limit, self.a, self.b, self.now, self.tried = limit, a, b, 0.0, []

    def clock(self) -> float:
        return self.now

    def try_length(self, T: int) -> dict:
        self.tried.append(T)
        cost = self.a * T + self.b * T * T
        self.now += cost
        return {"status": "oom"} if T > self.limit else {"status": "ok", "try_s": cost}


def test_doubling_lengths():
    assert doubling_lengths(4096, 1 << 20) == [4096 << i for i in range(9)]
    assert doubling_lengths(4096, 6000) == [4096]
    with pytest.raises(ValueError):
        doubling_lengths(8, 4)


def test_first_oom_ends_the_search_and_refinement_bisects_in_granules():
    gpu = FakeGPU(limit=3000)
    rows = search_lengths(gpu.try_length, doubling_lengths(256, 8192), deadline=1e9, clock=gpu.clock)
    assert gpu.tried == [256, 512, 1024, 2048, 4096]
    assert [r["status"] for r in rows] == ["ok"] * 4 + ["oom", "not tried"]
    assert longest(rows) == 2048
    gpu = FakeGPU(limit=3000)
    rows = search_lengths(gpu.try_length, doubling_lengths(256, 8192), deadline=1e9, clock=gpu.clock,
                          refine=3, granule=256)
    # 2048 ok, 4096 oom -> 3072 oom -> 2560 ok -> 2816 ok (the largest multiple of 256 <= 3000)
    assert gpu.tried[5:] == [3072, 2560, 2816]
    assert longest(rows) == 2816 and all(r.get("refined") for r in rows[-3:])


def test_nothing_fits_means_no_longest():
    gpu = FakeGPU(limit=100)
    rows = search_lengths(gpu.try_length, [256, 512], deadline=1e9, clock=gpu.clock, refine=2)
    assert gpu.tried == [256] and longest(rows) is None


def test_budget_skips_what_the_prediction_says_will_not_fit():
    # Linear cost 1 ms per token: 4K, 8K, 16K take 4.1, 8.2, 16.4 s; 32K is predicted at 32.8 s x 1.2
    # margin = 39 s, more than the 40 - 28.7 = 11 s left, so it and 64K are skipped, untried.
    gpu = FakeGPU(limit=1 << 30)
    rows = search_lengths(gpu.try_length, doubling_lengths(4096, 65536), deadline=40.0, clock=gpu.clock)
    assert gpu.tried == [4096, 8192, 16384]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "skipped", "skipped"]
    assert "predicted 39 s > 11 s left" in rows[3]["why"]
    assert longest(rows) == 16384


def test_prediction_is_quadratic_through_the_last_two():
    # s = a T + b T^2 with a = 1e-3, b = 1e-7: exact through two points.
    rows = [{"seq_len": t, "status": "ok", "try_s": 1e-3 * t + 1e-7 * t * t} for t in (1000, 2000)]
    assert predict_seconds(rows, 4000) == pytest.approx(1e-3 * 4000 + 1e-7 * 16e6)
    assert predict_seconds([], 4000) is None
    # A noisy shorter point (falling time per token) falls back to linear through the last one.
    rows = [{"seq_len": 1000, "status": "ok", "try_s": 5.0}, {"seq_len": 2000, "status": "ok", "try_s": 4.0}]
    assert predict_seconds(rows, 4000) == pytest.approx(8.0)


def test_loglog_slope_tells_linear_from_quadratic():
    lin = loglog_slope([(t, 3.0 * t) for t in (1024, 2048, 4096)])
    quad = loglog_slope([(t, 1e-6 * t * t) for t in (1024, 2048, 4096)])
    assert lin[0] is None and lin[1:] == pytest.approx([1.0, 1.0])
    assert quad[1:] == pytest.approx([2.0, 2.0])


@pytest.mark.slow   # child processes building and stepping a small model on CPU, ~1 min
def test_cli_dry_run_on_cpu_finds_the_fake_limit(tmp_path):
    """The whole script on CPU with tiny widths: real training steps in child processes, the
    out-of-memory path driven by --fake-oom-tokens; the JSON says what the table says."""
    out = tmp_path / "cap.json"
    result = main(["--device", "cpu", "--small", "--min-seq", "32", "--max-seq", "256", "--fake-oom-tokens", "64",
                   "--modes", "full,full+offload", "--one-child", "--parts", "modes", "--budget-s", "300",
                   "--json", str(out)])
    assert json.loads(out.read_text())["modes"].keys() == {"full", "full+offload"}
    for mode in ("full", "full+offload"):
        rows = result["modes"][mode]["rows"]
        assert [r["status"] for r in rows] == ["ok", "ok", "oom", "not tried"]
        assert result["modes"][mode]["longest"] == 64
        assert all(r["tokens_per_s"] > 0 and len(r["losses"]) == 3 for r in rows[:2])
