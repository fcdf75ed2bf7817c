"""``k3train predict-pipeline``: per-layer compute times measured on one process (or
read from a json), replayed through ``pipeline.timing_model`` for many (P, V, m), plus K3's real
shapes with the times scaled by FLOPs.

    python -m k3train predict-pipeline --config configs/k3_tiny.yaml --json OUT.json

How the per-op costs are measured: the engine runs on one process with one layer per chunk
(P = 1, V = L, ``CommRecorder`` spans), so chunk c's forward and backward time is layer c's
(chunk 0 includes the embedding, the last chunk the head). A layout's chunk costs are the sums
over its layers. Layer costs are measured per variant (standard residual, AttnRes + cache,
AttnRes naive: the same chunk compute, so the naive variant only differs in its messages).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import pipeline
from k3train.config import RunConfig, load_config
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.errors import UsageError
from k3train.model.flops import _attnres_sources, _kda_params, _mla_params, _moe_params, flops_breakdown
from k3train.model.model import K3Chunk, produced_blocks
from k3train.ops import kernels, triton_compile
from k3train.runtime.device import resolve_device
from k3train.runtime.distributed import init_distributed
from k3train.trainer.state import autocast_for
from pipeline import PipelineEngine, PipelineLayout
from pipeline.layout import split_layers
from pipeline.schedule import check_microbatches
from pipeline.timing_model import LinkCost, OpCosts, hop_messages, predict_step
from pipeline.transport import build_plan

VARIANTS = {"standard": (False, "cached"), "attnres_cached": (True, "cached"), "attnres_naive": (True, "naive")}
GRID_P, GRID_V, GRID_M = (2, 4, 8, 16), (1, 2, 4), (8, 16, 32)
# 2x H200 (NV18) p2p from benchmarks/README.md's sources: 197 GB/s at 16 MiB, 304 at 256 MiB, i.e.
# t = 32 us + bytes / 315 GB/s through both points.
H200_LINK = LinkCost(latency_s=32e-6, bandwidth_Bps=315e9)


def variant_config(cfg: RunConfig, variant: str) -> RunConfig:
    enabled, transport = VARIANTS[variant]
    model = cfg.model.model_copy(update={"attnres": cfg.model.attnres.model_copy(update={"enabled": enabled})})
    return cfg.model_copy(update={"model": model,
                                  "pipeline": cfg.pipeline.model_copy(update={"attnres_transport": transport})})


# ---- measuring ------------------------------------------------------------------------------
def measure_chunk_times(cfg: RunConfig, num_chunks: int, steps: int = 3, warmup: int = 1,
                        seed: int = 0, busy: dict | None = None) -> tuple[list[float], list[float]]:
    """Median forward and backward time of each of ``num_chunks`` chunks (seconds, one
    microbatch of ``train.micro_batch_size x train.seq_len`` tokens), timed by the engine's
    ``CommRecorder`` on this one process (P = 1, V = num_chunks: the hops are local hand-overs).
    ``train.microbatches`` microbatches per step; ``warmup`` untimed steps first.

    busy: if a dict, one more step runs under ``torch.profiler`` and the dict gets, per
    microbatch, ``span_s`` (that step's forward and backward spans summed), ``kernel_s``
    (its CUDA kernels' durations summed; None off CUDA) and ``host_ops`` (the host-side
    operators with the most self time, :func:`host_ops`). Spans are CUDA events, so where the
    host cannot keep the GPU fed they time the host's launches: kernel_s / span_s is how busy
    the GPU was inside them, and host_ops says what the host spent the time on."""

    device_name = resolve_device(cfg.train.device).type
    kernels.apply(cfg, pipeline_gpu=device_name == "cuda")   # the kernels a pipeline run would use
    init_distributed(1, 1, 1, 1, device_name)      # megatron's (size-1) groups, as a P=1 run has
    device = torch.device("cuda", torch.cuda.current_device()) if device_name == "cuda" else torch.device("cpu")
    layout = PipelineLayout(cfg.model.num_layers, 1, num_chunks)
    ranges = [(r.start, r.stop) for r in map(layout.layer_range, range(num_chunks))]
    torch.manual_seed(seed)
    chunks = {c: K3Chunk(cfg, *ranges[c], first=c == 0, last=c == num_chunks - 1).to(device)
              for c in range(num_chunks)}
    recorder = pipeline.CommRecorder()  # looked up on the package at call time (patchable)
    blocks = produced_blocks(cfg, ranges)
    engine = PipelineEngine(local_chunks=chunks, num_chunks=num_chunks, produced_blocks=blocks,
                            transport=cfg.pipeline.attnres_transport, recorder=recorder)
    B, T, m = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.train.microbatches

    def step(eng, tokens):  # tokens [m, B, T + 1]: one (inputs, targets) pair per microbatch
        with autocast_for(cfg, device):
            eng.train_step([(t[:, :-1], t[:, 1:]) for t in tokens])

    if kernels.uses_triton(device):
        # Every Triton kernel and autotune candidate compiled at once first (k3train.ops.
        # triton_compile), as the trainer does before step 1: under full autotuning they would
        # otherwise compile one by one in the warm-up step, for minutes. Through an engine
        # without the recorder, so that the throwaway pass leaves no spans.

        probe = PipelineEngine(local_chunks=chunks, num_chunks=num_chunks, produced_blocks=blocks,
                               transport=cfg.pipeline.attnres_transport)
        zeros = torch.zeros(m, B, T + 1, dtype=torch.long, device=device)
        triton_compile.compile_ahead(lambda: step(probe, zeros), label=f"{num_chunks} chunks")
        for ch in chunks.values():
            ch.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(seed)

    def timed_step():  # on the next random tokens
        step(engine, torch.randint(0, cfg.model.vocab_size, (m, B, T + 1), generator=gen).to(device))
        for ch in chunks.values():
            ch.zero_grad(set_to_none=True)

    for _ in range(warmup + steps):
        timed_step()
    spans = [s for s in recorder.compute if s.step >= warmup]
    med = {k: [statistics.median(s.end - s.start for s in spans if s.kind == k and s.chunk == c)
               for c in range(num_chunks)] for k in "FB"}
    if busy is not None:
        busy.update(_profiled_busy(timed_step, recorder, device, m))
    return med["F"], med["B"]


def profiled_events(run, cuda: bool):
    """``run()`` once under torch.profiler (host activity, and CUDA's when ``cuda``): its events,
    for :func:`device_work` and :func:`host_ops`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run()
    return prof.events()


def _profiled_busy(run_step, recorder, device, m: int) -> dict:
    """``run_step()`` under torch.profiler: per microbatch, its summed chunk spans and CUDA kernel time."""
    first = len(recorder.compute)
    events = profiled_events(run_step, device.type == "cuda")
    span = sum(s.end - s.start for s in recorder.compute[first:]) / m
    kernel_ms = device_work(events)["kernel_ms"]
    return {"span_s": span, "kernel_s": kernel_ms / 1e3 / m if kernel_ms is not None else None,
            "host_ops": host_ops(events, m)}


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def device_work(events) -> dict:
    """From one profiled step's events: ``kernel_ms`` (CUDA kernels' durations summed; None
    without any), ``launches`` (kernel-launch runtime calls) and ``host_ms`` (host self time of
    every host-side event). Kernel time does not depend on how fast the host launches, so the
    ratio of two runs' kernel_ms is the GPU work one adds over the other, free of host jitter."""
    from torch.autograd import DeviceType

    kernels = [e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    return {"kernel_ms": sum(kernels) / 1e3 if kernels else None,
            "launches": sum(e.name in LAUNCHES for e in host),
            "host_ms": sum(e.self_cpu_time_total for e in host) / 1e3}


def host_ops(events, m: int = 1, top: int = 30) -> list[dict]:
    """The ``top`` host-side profiler events by self time, per microbatch: ``[{"name",
    "self_ms", "calls"}]`` (self time and calls summed over every event of that name, divided
    by ``m``), largest first. Host-side: operators, Python-level ranges and CUDA runtime calls
    (``cudaLaunchKernel``'s count is the launches), not the kernels themselves."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        t = totals.setdefault(e.name, [0.0, 0])
        t[0] += e.self_cpu_time_total
        t[1] += 1
    rows = [{"name": n, "self_ms": us / 1e3 / m, "calls": c / m} for n, (us, c) in totals.items()]
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def host_excess(base: list[dict], other: list[dict], top: int = 12) -> list[dict]:
    """Per operator name, ``other``'s host self time and calls minus ``base``'s (both
    :func:`host_ops` lists; a name missing from one counts 0 there), the largest excess first."""
    b = {r["name"]: r for r in base}
    o = {r["name"]: r for r in other}
    rows = [{"name": n, "self_ms": o.get(n, {}).get("self_ms", 0.0) - b.get(n, {}).get("self_ms", 0.0),
             "calls": o.get(n, {}).get("calls", 0.0) - b.get(n, {}).get("calls", 0.0)} for n in {*b, *o}]
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def measure_layer_costs(cfg: RunConfig, steps: int = 3, progress=print, layers_per_chunk: int = 1) -> dict:
    """Per-layer forward/backward seconds per variant: ``{variant: {"fwd_s": [L], "bwd_s": [L]}}``
    (naive shares the cached variant's compute).

    layers_per_chunk: the engine times chunks of this many layers (``num_layers / k`` chunks at
    P = 1); each chunk's time is split over its layers in proportion to their FLOPs
    (:func:`split_by_flops`). 1 times every layer on its own. One-layer chunks' spans overstate
    AttnRes's cost against the whole step (docs/pipeline_timing_model.md): chunks of several
    layers, as a pipeline runs them, are the measurement that tells the two apart."""
    L = cfg.model.num_layers
    if layers_per_chunk < 1 or L % layers_per_chunk:
        raise UsageError(f"layers per chunk must divide model.num_layers={L}, got {layers_per_chunk}")
    num_chunks = L // layers_per_chunk
    out = {}
    for variant in ("standard", "attnres_cached"):
        vcfg = variant_config(cfg, variant)
        t0 = time.perf_counter()
        busy: dict = {}
        f, b = measure_chunk_times(vcfg, num_chunks, steps, busy=busy)
        out[variant] = {**split_by_flops(vcfg, {"fwd_s": f, "bwd_s": b}), "busy": busy}
        kernel = busy.get("kernel_s")
        gpu = ("" if kernel is None else f"; GPU kernels {kernel * 1e3:.1f} ms of a profiled step's "
               f"{busy['span_s'] * 1e3:.1f} ms of spans ({kernel / busy['span_s']:.0%} busy)")
        progress(f"measured {variant}: {L} layers in {num_chunks} chunks, forward {sum(f) * 1e3:.1f} ms + "
                 f"backward {sum(b) * 1e3:.1f} ms per microbatch{gpu} ({time.perf_counter() - t0:.0f} s)")
    ops = [out[v]["busy"].get("host_ops") for v in ("standard", "attnres_cached")]
    excess = host_excess(*ops) if all(ops) else []
    if excess:
        progress("host self time per microbatch, AttnRes cached minus standard (profiled steps):\n" + "\n".join(
            f"  {r['self_ms']:+9.2f} ms {r['calls']:+8.1f} calls  {r['name'][:90]}" for r in excess))
    out["attnres_naive"] = out["attnres_cached"]
    return out


def split_by_flops(cfg: RunConfig, chunk_times: dict) -> dict:
    """Per-layer ``{"fwd_s": [L], "bwd_s": [L]}`` from C chunks' times (C divides L, chunks as
    ``PipelineLayout(L, 1, C)`` splits them): each chunk's time shared by its layers in
    proportion to their training FLOPs, the head's counted in the last layer (as
    :func:`flop_scaled_layer_costs` does). With C = L it returns the chunk times unchanged."""

    L = cfg.model.num_layers
    C = len(chunk_times["fwd_s"])
    per_layer, head = layer_flops(cfg)
    per_layer[-1] += head
    layout = PipelineLayout(L, 1, C)
    out = {"fwd_s": [0.0] * L, "bwd_s": [0.0] * L}
    for c in range(C):
        layers = list(layout.layer_range(c))
        total = sum(per_layer[i] for i in layers)
        for i in layers:
            share = per_layer[i] / total if total else 1.0 / len(layers)
            for key in out:
                out[key][i] = chunk_times[key][c] * share
    return out


# ---- FLOPs per layer ------------------------------------------------------------------------
def layer_flops(cfg: RunConfig) -> tuple[list[float], float]:
    """Training FLOPs per token of each layer (the terms of ``k3train.model.flops``), and of the head
    (which also takes the final AttnRes depth attention)."""
    m = cfg.model
    kinds = expand_layer_pattern(m.layer_pattern, m.num_layers)
    br = flops_breakdown(cfg)
    n_k, n_m = kinds.count("K"), kinds.count("M")
    mixer = {"K": 6.0 * _kda_params(cfg) + (br["kda_recurrence"] / n_k if n_k else 0.0),
             "M": 6.0 * _mla_params(cfg) + (br["mla_attention"] / n_m if n_m else 0.0)}
    sources = _attnres_sources(m.num_layers, m.attnres.block_size) if m.attnres.enabled else None
    per_layer = []
    for i, kind in enumerate(kinds):
        ffn = 6.0 * (3 * m.hidden_size * m.ffn.intermediate_size if i < m.dense_layers else _moe_params(cfg))
        depth = 12.0 * m.hidden_size * (sources[2 * i] + sources[2 * i + 1]) if sources else 0.0
        per_layer.append(mixer[kind] + ffn + depth)
    head = 6.0 * m.hidden_size * m.vocab_size + (12.0 * m.hidden_size * sources[-1] if sources else 0.0)
    return per_layer, head


def flop_scaled_layer_costs(cfg: RunConfig, seconds_per_flop: float) -> dict:
    """Per-layer costs of ``cfg`` at a measured rate; backward = 2 x forward (FLOP counts)."""
    tokens = cfg.train.seq_len * cfg.train.micro_batch_size
    per_layer, head = layer_flops(cfg)
    per_layer[-1] += head
    total = [x * tokens * seconds_per_flop for x in per_layer]
    return {"fwd_s": [t / 3 for t in total], "bwd_s": [2 * t / 3 for t in total]}


def seconds_per_flop(cfg: RunConfig, layer_costs: dict) -> float:
    tokens = cfg.train.seq_len * cfg.train.micro_batch_size
    per_layer, head = layer_flops(cfg)
    return (sum(layer_costs["fwd_s"]) + sum(layer_costs["bwd_s"])) / ((sum(per_layer) + head) * tokens)


# ---- prediction -----------------------------------------------------------------------------
def chunk_costs(layer_costs: dict, num_layers: int, num_chunks: int, **overheads) -> OpCosts:
    counts = split_layers(num_layers, num_chunks)
    f, b, start = [], [], 0
    for n in counts:
        f.append(sum(layer_costs["fwd_s"][start:start + n]))
        b.append(sum(layer_costs["bwd_s"][start:start + n]))
        start += n
    return OpCosts(tuple(f), tuple(b), **overheads)


def layout_messages(cfg: RunConfig, P: int, V: int, wire_bytes: int = 4):
    """Per-hop messages of one microbatch: hidden and blocks are [B, T, D] at ``wire_bytes``,
    ``T = seq_len / cp`` (under context parallelism each CP rank sends its own slice)."""
    counts = split_layers(cfg.model.num_layers, P * V)
    starts = [sum(counts[:c]) for c in range(P * V)]
    ranges = [(s, s + n) for s, n in zip(starts, counts)]
    plan = build_plan(produced_blocks(cfg, ranges), P, cfg.pipeline.attnres_transport)
    d = cfg.train.micro_batch_size * (cfg.train.seq_len // cfg.parallel.cp) * cfg.model.hidden_size * wire_bytes
    return hop_messages(plan, d, d)


def predict_variant(cfg: RunConfig, variant: str, layer_costs: dict, P: int, V: int, m: int,
                    link: LinkCost, overlap_sends: bool = True, **overheads):
    vcfg = variant_config(cfg, variant)
    costs = chunk_costs(layer_costs, cfg.model.num_layers, P * V, **overheads)
    return predict_step(P, V, m, costs, layout_messages(vcfg, P, V), link, overlap_sends)


def predict_table(cfg: RunConfig, costs: dict, link: LinkCost, grid=(GRID_P, GRID_V, GRID_M),
                  overlap_sends: bool = True) -> list[dict]:
    """One row per (P, V, m) the layout allows: step ms per variant, bubble, AttnRes overhead."""

    rows = []
    for P in grid[0]:
        for V in grid[1]:
            for m in grid[2]:
                if P * V > cfg.model.num_layers:
                    continue
                try:
                    check_microbatches(P, V, m)
                except ValueError:
                    continue
                row = {"P": P, "V": V, "m": m}
                for variant in VARIANTS:
                    pred = predict_variant(cfg, variant, costs[variant], P, V, m, link, overlap_sends)
                    row[f"{variant}_ms"] = pred.step_s * 1e3
                    if variant == "standard":
                        row["bubble"] = pred.bubble
                row["attnres_cached_overhead"] = row["attnres_cached_ms"] / row["standard_ms"] - 1
                row["attnres_naive_overhead"] = row["attnres_naive_ms"] / row["standard_ms"] - 1
                rows.append(row)
    return rows


def format_table(rows: list[dict], title: str, unit: str = "ms") -> str:
    scale = 1e-3 if unit == "s" else 1.0
    lines = [title, f"{'P':>3}{'V':>3}{'m':>4}{'standard ' + unit:>13}{'cached ' + unit:>11}{'naive ' + unit:>10}"
                    f"{'cached vs std':>15}{'naive vs std':>14}{'bubble':>8}"]
    for r in rows:
        lines.append(f"{r['P']:>3}{r['V']:>3}{r['m']:>4}{r['standard_ms'] * scale:>13.1f}"
                     f"{r['attnres_cached_ms'] * scale:>11.1f}{r['attnres_naive_ms'] * scale:>10.1f}"
                     f"{r['attnres_cached_overhead']:>+15.1%}{r['attnres_naive_overhead']:>+14.1%}{r['bubble']:>8.3f}")
    return "\n".join(lines)


def run_predict(cfg: RunConfig, json_path: str | Path, costs_path: str | None = None,
                k3_config: str | None = "configs/k3_full.yaml", link: LinkCost = H200_LINK,
                steps: int = 3, layers_per_chunk: int = 1) -> dict:
    """Measure (or load) per-layer costs of ``cfg``, print and write the prediction tables."""
    if costs_path and layers_per_chunk != 1:
        raise UsageError(f"layers per chunk ({layers_per_chunk}) sets how costs are measured; with a costs json "
                         f"({costs_path}) nothing is measured: drop one of the two")
    if costs_path:
        costs = json.loads(Path(costs_path).read_text())
        costs = costs.get("layer_costs", costs)     # a whole --predict report works too
        bad = [v for v in VARIANTS if v not in costs or len(costs[v].get("fwd_s", ())) != cfg.model.num_layers]
        if bad:
            raise UsageError(f"{costs_path}: needs fwd_s and bwd_s of {cfg.model.num_layers} layers for "
                              f"each of {list(VARIANTS)}; missing or wrong length: {bad}")
        print(f"per-layer costs from {costs_path}")
    else:
        costs = measure_layer_costs(cfg, steps, layers_per_chunk=layers_per_chunk)
    report = {"link": {"latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps},
              "layer_costs": costs, "measured_config": {"num_layers": cfg.model.num_layers,
                                                         "hidden_size": cfg.model.hidden_size,
                                                         "seq_len": cfg.train.seq_len,
                                                         "micro_batch_size": cfg.train.micro_batch_size,
                                                         "layers_per_chunk": None if costs_path else layers_per_chunk}}
    report["table"] = predict_table(cfg, costs, link)
    print(format_table(report["table"], f"predicted from measured per-layer costs "
                                        f"(link {link.latency_s * 1e6:.0f} us + bytes / {link.bandwidth_Bps / 1e9:.0f} GB/s)"))
    if k3_config:

        k3 = load_config(k3_config)
        rates = {v: seconds_per_flop(variant_config(cfg, v), costs[v]) for v in VARIANTS}
        k3_costs = {v: flop_scaled_layer_costs(variant_config(k3, v), rates[v]) for v in VARIANTS}
        report["k3_rate_flops"] = {v: 1 / r for v, r in rates.items()}
        report["k3_table"] = predict_table(k3, k3_costs, link, grid=((16,), (1, 2, 4), (16, 32, 64)))
        print()
        print(format_table(report["k3_table"], f"PREDICTED for {k3_config} (hidden {k3.model.hidden_size}, "
                                               f"{k3.model.num_layers} layers, AttnRes blocks of "
                                               f"{k3.model.attnres.block_size}), compute scaled by FLOPs at "
                                               f"{1 / rates['standard'] / 1e12:.3g} TFLOP/s measured here", unit="s"))
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(report, indent=1))
    print(f"wrote {json_path}")
    return report
