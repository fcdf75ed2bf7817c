"""The capacity benchmark's search over sequence lengths (``benchmarks/bench_capacity.py``): pure
logic, tested on CPU against a fake out-of-memory threshold and a fake clock
(tests/benchmarks/test_bench_capacity.py)."""
from __future__ import annotations

import math
import time

# --------------------------------------------------------------------------------------------
# The search (pure logic: CPU-tested against a fake out-of-memory threshold and a fake clock)
# --------------------------------------------------------------------------------------------

def doubling_lengths(min_seq: int, max_seq: int) -> list[int]:
    """``min_seq, 2 min_seq, 4 min_seq, ...`` up to ``max_seq`` (powers of two from 4K upward by
    default)."""
    if min_seq < 1 or max_seq < min_seq:
        raise ValueError(f"need 1 <= min-seq <= max-seq, got {min_seq} and {max_seq}")
    out, t = [], min_seq
    while t <= max_seq:
        out.append(t)
        t *= 2
    return out


def predict_seconds(rows: list[dict], T: int) -> float | None:
    """Seconds a try at length ``T`` should take, from the measured tries (``seq_len``,
    ``try_s``): ``a T + b T^2`` through the last two (``b >= 0``), or linear through one; None
    before any."""
    done = [(r["seq_len"], r["try_s"]) for r in rows if r.get("status") == "ok" and "try_s" in r]
    if not done:
        return None
    if len(done) == 1:
        t1, s1 = done[-1]
        return s1 * T / t1
    (t1, s1), (t2, s2) = done[-2], done[-1]
    # s = a t + b t^2 through both points; a negative b (noise at short lengths) means linear.
    b = (s2 / t2 - s1 / t1) / (t2 - t1) if t2 != t1 else 0.0
    if b < 0:
        return s2 * T / t2
    a = s2 / t2 - b * t2
    return max(a * T + b * T * T, s2 * T / t2)


def search_lengths(try_length, lengths: list[int], *, deadline: float, clock=time.monotonic,
                   refine: int = 0, granule: int | None = None, margin: float = 1.2,
                   report=lambda row: None) -> list[dict]:
    """Tries ``lengths`` (ascending) until one runs out of memory; returns one row per length.

    try_length(T) -> dict with ``status`` "ok" (and ``try_s``, its wall time) or "oom". Memory
    grows with T, so the first "oom" ends the search; ``refine`` bisection steps then try
    lengths between the longest "ok" and that "oom" in multiples of ``granule``. A length whose
    predicted time (``predict_seconds`` x ``margin``) exceeds what is left before ``deadline``
    is not tried: it and every longer one get ``status`` "skipped" with the reason. ``report``
    sees each row as it is made."""

    rows: list[dict] = []

    def attempt(T: int) -> dict | None:
        left = deadline - clock()
        est = predict_seconds(rows, T)
        if left <= 0 or (est is not None and est * margin > left):
            why = (f"predicted {est * margin:.0f} s > {max(left, 0):.0f} s left of the budget" if est is not None
                   else "no time left of the budget")
            row = {"seq_len": T, "status": "skipped", "why": why}
        else:
            row = dict(try_length(T), seq_len=T)
        rows.append(row)
        report(row)
        return row

    first_oom = None
    for i, T in enumerate(lengths):
        row = attempt(T)
        if row["status"] == "skipped":
            for later in lengths[i + 1:]:
                rows.append({"seq_len": later, "status": "skipped", "why": "a shorter length was skipped"})
                report(rows[-1])
            break
        if row["status"] == "oom":
            first_oom = T
            for later in lengths[i + 1:]:
                rows.append({"seq_len": later, "status": "not tried", "why": f"{T} ran out of memory"})
                report(rows[-1])
            break
    ok = [r["seq_len"] for r in rows if r["status"] == "ok"]
    if refine and first_oom is not None and ok:
        lo, hi, g = max(ok), first_oom, granule or min(lengths)
        for _ in range(refine):
            mid = (lo + hi) // 2 // g * g
            if mid <= lo or mid >= hi:
                break
            row = attempt(mid)
            row["refined"] = True
            if row["status"] == "ok":
                lo = mid
            elif row["status"] == "oom":
                hi = mid
            else:
                break
    return rows


def longest(rows: list[dict]) -> int | None:
    ok = [r["seq_len"] for r in rows if r.get("status") == "ok"]
    return max(ok) if ok else None


def loglog_slope(points: list[tuple[int, float]]) -> list[float | None]:
    """Slope of log(ms) against log(T) from each point to the next (1: linear, 2: quadratic)."""
    out: list[float | None] = [None]
    for (t1, a), (t2, b) in zip(points, points[1:]):
        out.append(math.log(b / a) / math.log(t2 / t1) if a > 0 and b > 0 else None)
    return out
