"""Helpers shared by the benchmarks: CUDA-event / perf_counter timing (medians), the measured matmul
rate, a profile table, and the JSON writer."""
from __future__ import annotations

import json
import statistics
import time

import torch


def timeit(fn, warmup: int = 3, iters: int = 10, device: str = "cuda") -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph: its device time without the
    host's launch cost (``fn`` runs 3 times on a side stream first, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timeit(graph.replay, warmup=2, iters=iters)


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """Measured dense matmul rate (TFLOP/s) of this GPU, the peak the MFU figures use."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = timeit(lambda: a @ b, warmup=3, iters=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def profile_table(fn, iters: int = 2, rows: int = 25, device: str = "cuda", shapes: bool = False) -> str:
    """Top ``rows`` operators of ``iters`` calls of ``fn`` by device time (where a step's time goes).

    shapes: also record input shapes and split each operator's row by them (attributes, e.g.,
    ``aten::copy_`` calls to the tensors they copy)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(iters):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    width = 100 if shapes else 60
    return prof.key_averages(group_by_input_shape=shapes).table(
        sort_by=key, row_limit=rows, max_name_column_width=60, max_shapes_column_width=width)


def op_table(fn, iters: int = 2, rows: int = 40) -> str:
    """The ``aten::`` operators of ``iters`` eager calls of ``fn`` on CUDA, split by input
    shapes, by the device time of the kernels each launched: which op and tensor an anonymous
    elementwise kernel of ``profile_table`` belongs to (a replayed CUDA graph shows kernels only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    lines = [f"{'device ms':>10} {'calls':>6}  op  input shapes"]
    for e in ops[:rows]:
        lines.append(f"{e.self_device_time_total / 1e3:>10.2f} {e.count:>6}  {e.key}  {e.input_shapes}"[:200])
    return "\n".join(lines)


def save_json(path: str | None, result: dict) -> None:
    """Write a benchmark's result dict to ``path`` (the ``--json`` option); nothing when None."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
