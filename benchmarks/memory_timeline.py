"""Where a step's memory peak is: torch.profiler's memory timeline of one call, read at its peak.

    from benchmarks.memory_timeline import profile_peak
    peak = profile_peak(lambda: state.train_step(batch), torch.device("cuda"))

``torch.cuda.max_memory_allocated`` says how high a step's memory went, not when or of what.
The profiler (``profile_memory=True``, ``with_stack=True``) records every allocation and free with
its operator, and its memory timeline sorts the live bytes into categories (parameters,
gradients, optimizer state, activations, temporaries, autograd's own buffers). Read at the
moment the total is highest, that says which phase of the step sets the peak (a microbatch's
backward, the optimizer step) and which operator is running: what the memory planner
(k3train/profiling/memory_plan.py) must model to predict that peak. It uses the profiler's internal
``_memory_profiler`` module (torch 2.1+); the categories are its heuristics, the total is exact.
Works on CPU (tests) and CUDA.
"""
from __future__ import annotations

import torch

# Python frames and operators that say which phase of a training step an instant belongs to.
_PHASES = (("optimizer", ("Optimizer.step", "optim/", "_fused_adam", "muon")),
           ("backward", ("autograd::engine::evaluate_function", "Backward", "backward")),
           ("forward", ("forward", "nn.Module:")))


def phase_of(frames: list[str]) -> str:
    """``optimizer``, ``backward``, ``forward`` or ``other``: the first of those a frame's name
    points to, checked in that order (a backward runs inside the step's forward-backward call, a
    recomputed forward inside a backward)."""
    for phase, marks in _PHASES:
        if any(m in f for f in frames for m in marks):
            return phase
    return "other"


def profile_peak(fn, device: torch.device, frames: int = 12) -> dict:
    """Run ``fn()`` once under the profiler. Returns ``{"peak_bytes", "categories": {name: bytes},
    "phase", "at": [innermost event names, up to frames], "fraction"}`` for ``device``'s
    memory at its highest point; ``fraction``: when in the call it was, 0 at its start and 1
    at its end."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Category, MemoryProfileTimeline

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    timeline = MemoryProfileTimeline(prof._memory_profile())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    times, sizes = timeline._coalesce_timeline(device)       # times in us; sizes [T][1 + categories]
    if not times:
        return {"peak_bytes": 0, "categories": {}, "phase": "other", "at": [], "fraction": None}
    totals = [sum(row) for row in sizes]
    i = max(range(len(totals)), key=totals.__getitem__)
    names = ["unknown"] + [c.name for c in Category]
    t_ns = times[i] * 1000
    events = [e for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CPU
              and e.start_ns() <= t_ns <= e.start_ns() + e.duration_ns()]
    events.sort(key=lambda e: e.duration_ns())            # innermost first
    at = [e.name() for e in events[:frames]]
    return {"peak_bytes": totals[i], "categories": {n: b for n, b in zip(names, sizes[i]) if b},
            "phase": phase_of([e.name() for e in events]), "at": at,
            "fraction": (times[i] - times[0]) / max(times[-1] - times[0], 1)}


def format_peak(peak: dict, unit: float = 2 ** 30, label: str = "GiB") -> str:
    """Two lines: the peak, its phase and categories; the innermost events at that instant."""
    cats = ", ".join(f"{k.lower()} {v / unit:.2f}" for k, v in
                     sorted(peak["categories"].items(), key=lambda kv: -kv[1]))
    where = " < ".join(peak["at"][:6])
    frac = "" if peak["fraction"] is None else f" at {peak['fraction']:.0%} of the step"
    return (f"peak {peak['peak_bytes'] / unit:.2f} {label} in the {peak['phase']}{frac}: {cats}\n"
            f"  running: {where}")
