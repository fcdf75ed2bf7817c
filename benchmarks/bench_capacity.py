"""Capacity of one GPU: the longest trainable sequence per recompute mode, tokens/s and peak memory
from 4K to it, where a layer's time goes as the sequence grows, and what document masking costs.

    python3 -m benchmarks.bench_capacity --config configs/k3_mini.yaml --budget-s 540 --json OUT/mini.json
    python3 -m benchmarks.bench_capacity --config configs/k3_mini.yaml --modes full+offload \\
        --min-seq 1048576 --parts modes --budget-s 560 --json OUT/mini_1m.json     # K3's 1M on one GPU
    python3 -m benchmarks.bench_capacity --config configs/k3_slice.yaml --modes none,selective,full \\
        --one-child --parts modes --budget-s 560 --json OUT/slice.json
    python3 -m benchmarks.bench_capacity --quick --json OUT/quick.json            # 4K..32K, ~3 min
    python3 -m benchmarks.bench_capacity --device cpu --small --min-seq 32 --max-seq 256 \\
        --mask-seqs 64 --fake-oom-tokens 128 --budget-s 300                       # CPU dry run

The capacity table in five device calls of at most 600 s each (one H200; PASS is what each
should show):

    1. --config configs/k3_mini.yaml --modes none,selective,full --parts modes --budget-s 540
       the longest length per mode, with tokens/s and peak GiB from 4K up (PASS: a table)
    2. --config configs/k3_mini.yaml --modes full+offload --min-seq 262144 --parts check,modes \
       --budget-s 540     the offload check (PASS) and 256K, 512K, 1M with offload
       (PASS for the 1M goal: the 1048576 row is "ok")
    3. --config configs/k3_mini.yaml --parts split,mask --max-seq 524288 --budget-s 540
       KDA slope ~1, MLA slope -> 2, MLA share growing; masked / unmasked eager at 4K and 32K
    4. --config configs/k3_slice.yaml --modes none,selective,full --one-child --parts modes \
       --budget-s 540     (the slice builds once, minutes)
    5. --config configs/k3_slice.yaml --modes full+offload --min-seq 16384 --parts modes \
       --budget-s 540     toward the slice's 64K goal

Parts (``--parts``, default modes, split and mask, in this order, sharing ``--budget-s``):

* ``check`` (not in the default; first when asked): offload against no offload on the device,
  the forward/backward of one ``--check-seq`` sequence under ``full`` twice (a control for the
  kernels' own determinism) and under ``full+offload``, same weights and batch: the largest
  difference of the loss and every gradient, and the bytes moved to the host. PASS: offload's
  difference is no larger than the control's and bytes moved.

* ``modes``: for each recompute mode of ``--modes`` (``none``, ``selective``, ``full``; a
  ``+offload`` suffix adds ``train.offload_activations=true``), one sequence per microbatch
  (``train.micro_batch_size=1``), the lengths ``min-seq, 2 min-seq, ...`` up to ``max-seq`` in
  turn: ``--warmup`` untimed steps and up to ``--steps`` timed ``TrainState.train_step`` calls
  (forward, backward, clip and optimizer update: what ``k3train train`` runs, eager), tokens/s
  from the median step and the peak of ``torch.cuda.max_memory_allocated`` over them. The first
  length that runs out of memory (``torch.OutOfMemoryError``, caught) ends the mode: the one
  before it is the longest that trains; ``--refine N`` then bisects N times between the two in
  multiples of ``min-seq``. Each mode runs in a child process of its own, so that an out-of-memory
  or a crashed kernel in one mode leaves the others' memory and CUDA context clean; rows come
  back line by line, so a killed child keeps what it measured. ``--one-child`` runs every mode
  in one child instead, the model built once and its recompute mode switched between modes (it
  is read only in the forward): for the K3 slice, whose build takes minutes. Each row also
  carries the memory planner's prediction (``k3train model-info``) for comparison.
* ``split``: where a layer's time goes, at each length up to the longest any mode trained: the
  forward + backward of one KDA mixer, one MLA mixer and one MoE FFN of the model on their own
  (``[1, T, D]`` input, bf16 autocast, no recompute, CUDA events), in ms and in ms per 1K tokens;
  the log-log slope between lengths (1: linear, 2: quadratic) and the layer types' shares of
  the sum over the model's layers (counts from the layer pattern). Isolated layers, not the
  step's own timeline: a layer's time in the step also includes its recompute.
* ``mask``: at each of ``--mask-seqs`` (4K and 32K), windows holding a document every
  ``--doc-len`` tokens (default a quarter window), trained unmasked eager, masked eager
  (``data.document_mask=true``) and unmasked with ``train.cuda_graph=auto`` (graphed where the
  trainer graphs: what a user of unmasked windows gets), same batches, recompute none
  (``benchmarks.bench_step.ours``). masked / unmasked eager is the masking cost.

Budget: every part and every length is skipped, and said so in the table and the JSON, when
what is left of ``--budget-s`` cannot hold it (the time of the next length is predicted from the
last two, a T + b T^2); a child is killed at its deadline. ``--quick``: 4K to 32K, one timed step,
no refinement, masking at 4K only.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from types import SimpleNamespace

import torch

from benchmarks.bench_step import SMALL, ours
from benchmarks.common import save_json, timeit
from k3train.config import load_config
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.model.model import K3Chunk, build_model
from k3train.model.offload import ActivationOffload
from k3train.profiling.memory_plan import plan_memory
from k3train.runtime.distributed import init_distributed
from k3train.trainer.state import TrainState, autocast_for

warnings.filterwarnings("ignore")

GiB = 2 ** 30
# A child's fixed costs beyond its lengths (building the model on the host, compiling the
# kernels), used to decide whether a mode still fits the budget; measured on k3_mini.
SETUP_S = 45.0
SLICE_SETUP_S = 150.0


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


# --------------------------------------------------------------------------------------------
# Children: one recompute mode's lengths, the layer split, the masking rows
# --------------------------------------------------------------------------------------------

def _mode_overrides(mode: str) -> list[str]:
    base, _, extra = mode.partition("+")
    if base not in ("none", "selective", "full") or extra not in ("", "offload"):
        raise ValueError(f"a mode is none, selective or full, optionally +offload; got {mode!r}")
    return [f"train.recompute={base}", f"train.offload_activations={'true' if extra else 'false'}"]


def _base_overrides(args, seq: int) -> list[str]:
    small = [*SMALL] if args.small else []
    return [*small, f"train.device={args.device}", "train.micro_batch_size=1", "train.microbatches=1",
            f"train.seq_len={seq}", "logging.wandb.mode=disabled", *args.override]


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reset_step_state(state) -> None:
    """After a step that ran out of memory: no gradient, no routing record is left behind."""
    state.optimizer.zero_grad(set_to_none=True)
    for layer in state.moe_layers:
        layer.routing.clear()
    offload = getattr(state.model, "offload", None)
    if offload is not None:
        offload.reset_stats()


def _is_oom(exc: BaseException) -> bool:
    """Out of device memory, or out of pinned host memory (offload), or a library's workspace
    allocation failing under memory pressure (cuBLAS, cuDNN): all mean "this length does not fit"."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return any(k in text for k in ("out of memory", "ALLOC_FAILED", "cudaErrorMemoryAllocation"))


def _measure(state, T: int, args) -> dict:
    """``--warmup`` untimed and up to ``--steps`` timed steps at length T (one sequence); a step
    over ``--long-step-s`` is timed once."""
    dev = args.device
    _free(dev)
    g = torch.Generator().manual_seed(T)
    batch = torch.randint(0, state.cfg.model.vocab_size, (1, T + 1), generator=g)
    offload = getattr(state.model, "offload", None)
    t_start = time.monotonic()
    times, losses, oom = [], [], None
    try:
        if args.fake_oom_tokens and T > args.fake_oom_tokens:
            raise torch.OutOfMemoryError(f"fake: {T} > --fake-oom-tokens {args.fake_oom_tokens}")
        for i in range(args.warmup + args.steps):
            if offload is not None:
                offload.reset_stats()
            _sync(dev)
            t0 = time.perf_counter()
            out = state.train_step(batch)
            _sync(dev)
            dt = time.perf_counter() - t0
            losses.append(out["loss"])
            if i >= args.warmup:
                times.append(dt)
                if dt > args.long_step_s:
                    break
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not _is_oom(exc):
            raise   # anything else (a broken kernel) ends this child; the parent keeps its rows
        oom = str(exc).splitlines()[0][:240]
    row = {"status": "oom" if oom else "ok", "try_s": time.monotonic() - t_start}
    if dev == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        row["reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    if oom:
        row["error"] = oom
        _reset_step_state(state)
    else:
        step = statistics.median(times)
        row.update(step_s=step, tokens_per_s=T / step, timed_steps=len(times), losses=losses)
        if offload is not None:
            row["host_offloaded_gib"] = offload.stats.offloaded_bytes / GiB
    del batch
    _free(dev)
    return row


def _switch_mode(state, mode: str) -> None:
    """Run ``state``'s model under recompute ``mode`` from now on: the model reads
    ``train.recompute`` and ``train.offload_activations`` only in its forward (``K3Chunk``), so
    this is the model the mode's config builds, with the same weights, without building it again
    (the K3 slice takes minutes to build)."""
    base, _, extra = mode.partition("+")
    for module in state.model.modules():
        if isinstance(module, K3Chunk):
            module.recompute = base
            module.offload = ActivationOffload() if extra == "offload" else None


def worker_mode(args) -> None:
    """The lengths of each recompute mode of ``--worker`` (a comma list) in this one process, the
    model built once; a JSON line per row (with its ``mode``) into ``--worker-out``. Each mode gets
    an equal share of the time left when it starts."""
    modes = args.worker.split(",")
    lengths = doubling_lengths(args.min_seq, args.max_seq)
    cfg = load_config(args.config, [*_base_overrides(args, lengths[0]), *_mode_overrides(modes[0]),
                                    "train.cuda_graph=false", "data.document_mask=false"])
    out = open(args.worker_out, "a")

    def report(row, mode=None):
        out.write(json.dumps(row if mode is None else dict(row, mode=mode)) + "\n")
        out.flush()

    t0 = time.monotonic()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device=args.device), dev)
    state.schedule_lr(1)   # the warm-up rate of step 1, as a run starts (not the full rate)
    state.compile_kernels()
    report({"setup_s": time.monotonic() - t0, "params": sum(p.numel() for p in state.params),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "static_gib": (torch.cuda.memory_allocated() / GiB) if args.device == "cuda" else None})
    end = time.monotonic() + (args.deadline - time.time())
    for i, mode in enumerate(modes):
        _switch_mode(state, mode)
        deadline = time.monotonic() + (end - time.monotonic()) / (len(modes) - i)
        search_lengths(lambda T: _measure(state, T, args), lengths, deadline=deadline, refine=args.refine,
                       granule=args.min_seq, report=lambda row, m=mode: report(row, m))


def _layer_fns(model, cfg, device):
    """(name, index, fn(x) -> output) for one KDA mixer, one MLA mixer and one MoE FFN."""
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    out = []
    for kind, name in (("K", "kda"), ("M", "mla")):
        if kind in kinds:
            i = kinds.index(kind)
            layer = model.layers[i]
            out.append((name, i, lambda x, layer=layer: layer.mixer(layer.mixer_norm(x))))
    moe = [i for i in range(cfg.model.num_layers) if i >= cfg.model.dense_layers]
    if moe:
        layer = model.layers[moe[0]]
        out.append(("moe", moe[0], lambda x, layer=layer: layer._ffn(x)))
    return out


def worker_split(args) -> None:
    """Isolated fwd+bwd of one layer of each type at each length; JSON lines."""
    lengths = [int(t) for t in args.lengths.split(",")]
    cfg = load_config(args.config, [*_base_overrides(args, lengths[0]), "train.recompute=none",
                                    "train.cuda_graph=false", "data.document_mask=false"])
    init_distributed(device=args.device)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(cfg).to(dev)
    model.train()
    autocast = autocast_for(cfg, dev)
    out = open(args.worker_out, "a")
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    counts = {"kda": kinds.count("K"), "mla": kinds.count("M"),
              "moe": sum(1 for i in range(cfg.model.num_layers) if i >= cfg.model.dense_layers)}
    out.write(json.dumps({"counts": counts}) + "\n")
    out.flush()
    dtype = torch.bfloat16 if args.device == "cuda" and cfg.precision.recipe != "fp32" else torch.float32
    fns = _layer_fns(model, cfg, dev)
    deadline = time.monotonic() + (args.deadline - time.time())

    def try_length(T: int) -> dict:
        t_start = time.monotonic()
        row = {"status": "ok", "ms": {}}
        for name, index, fn in fns:
            x = torch.randn(1, T, cfg.model.hidden_size, device=dev, dtype=dtype, requires_grad=True)

            def run():
                with autocast:
                    y = fn(x)
                y.backward(torch.ones_like(y))
                x.grad = None
                for p in model.parameters():
                    p.grad = None
                for layer in model.moe_layers():
                    layer.routing.clear()
            try:
                # One warm-up (autotune at this shape), then the median of up to 3 timed calls.
                row["ms"][name] = timeit(run, warmup=1, iters=1 if T >= 262144 else 3, device=args.device)
            except torch.OutOfMemoryError:
                row["ms"][name] = None
            del x
            _free(args.device)
        row["try_s"] = time.monotonic() - t_start
        return row

    search_lengths(try_length, lengths, deadline=deadline,
                   report=lambda row: (out.write(json.dumps(row) + "\n"), out.flush()))


def worker_check(args) -> None:
    """Offload against no offload on the device: the forward/backward of one sequence of
    ``--check-seq`` tokens under ``full``, twice (the control: is the GPU step itself
    deterministic?), then under ``full+offload``, same weights and batch; the loss and every
    gradient compared. PASS: offload's largest difference is no larger than the control's (both
    0 where the kernels are deterministic) and the hooks moved bytes to the host."""
    out = open(args.worker_out, "a")
    T = args.check_seq
    cfg = load_config(args.config, [*_base_overrides(args, T), *_mode_overrides("full"),
                                    "train.cuda_graph=false", "data.document_mask=false"])
    dev = torch.device(args.device)
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device=args.device), dev)
    batch = torch.randint(0, cfg.model.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(1))

    def grads(mode: str):
        _switch_mode(state, mode)
        _free(args.device)
        loss = state._forward_backward(batch)
        _sync(args.device)
        g = [p.grad.detach().clone() if p.grad is not None else None for p in state.params]
        offload = getattr(state.model, "offload", None)
        moved = offload.stats.offloaded_bytes if offload is not None else 0
        state.optimizer.zero_grad(set_to_none=True)
        for layer in state.moe_layers:
            layer.routing.clear()
        peak = torch.cuda.max_memory_allocated() / GiB if args.device == "cuda" else None
        return loss.detach().clone(), g, moved, peak

    def diff(a, b) -> float:
        (la, ga, _, _), (lb, gb, _, _) = a, b
        d = (la.float() - lb.float()).abs().item()
        for x, y in zip(ga, gb):
            if (x is None) != (y is None):
                return float("inf")
            if x is not None:
                d = max(d, (x.float() - y.float()).abs().max().item())
        return d

    ref = grads("full")
    again = grads("full")
    off = grads("full+offload")
    control, offload_diff = diff(ref, again), diff(ref, off)
    row = {"seq_len": T, "loss_full": ref[0].item(), "loss_offload": off[0].item(),
           "control_max_diff": control, "offload_max_diff": offload_diff,
           "offloaded_gib": off[2] / GiB, "peak_gib_full": ref[3], "peak_gib_offload": off[3],
           "pass": offload_diff <= control and off[2] > 0}
    out.write(json.dumps(row) + "\n")
    out.flush()


def worker_mask(args) -> None:
    """Masked and unmasked windows at each of --mask-seqs; JSON lines."""
    out = open(args.worker_out, "a")
    deadline = args.deadline
    small = [*SMALL] if args.small else []
    for seq in [int(s) for s in args.mask_seqs.split(",") if s]:
        doc_len = args.doc_len or max(1, seq // 4)
        # Three warm-up steps: a graphed row captures after two eager steps (from step 3).
        ns = SimpleNamespace(device=args.device, mbs=1, seq=seq, steps=args.mask_steps, warmup=3,
                             profile=False, profile_shapes=False, profile_ops=False)
        base = [*small, "train.recompute=none", *args.override]
        rows = [("unmasked_eager", [*base, "train.cuda_graph=false", "data.document_mask=false"]),
                ("masked_eager", [*base, "train.cuda_graph=false", "data.document_mask=true"]),
                ("unmasked_graphed", [*base, "train.cuda_graph=false" if args.device == "cpu" else "train.cuda_graph=auto",
                                      "data.document_mask=false"])]
        for name, overrides in rows:
            if time.time() > deadline:
                row = {"status": "skipped", "why": "no time left of the budget"}
            else:
                t0 = time.monotonic()
                try:
                    r = ours(args.config, overrides, ns, 0.0, doc_len=doc_len)
                    row = {"status": "ok", "tokens_per_s": r["tokens_per_s"], "step_ms": r["step_ms"],
                           "peak_gib": r.get("peak_mem_gib"), "last_loss": r["last_loss"]}
                except torch.OutOfMemoryError as exc:
                    row = {"status": "oom", "error": str(exc).splitlines()[0][:240]}
                row["try_s"] = time.monotonic() - t0
                _free(args.device)
            out.write(json.dumps(dict(row, seq_len=seq, doc_len=doc_len, row=name)) + "\n")
            out.flush()


# --------------------------------------------------------------------------------------------
# The parent: budget, children, planner figures, table, JSON
# --------------------------------------------------------------------------------------------

def _child(args, kind: str, deadline_wall: float, extra: list[str]) -> tuple[list[dict], str | None]:
    """Runs a child (``--worker kind``) until ``deadline_wall`` (+ a grace period to report);
    returns its JSON lines and why it ended early (None when it exited cleanly)."""
    # Beside the --json output where there is one (a run's own folder), else the system's temp.
    where = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, dir=where) as f:
        path = f.name
    cmd = [sys.executable, "-m", "benchmarks.bench_capacity", "--worker", kind, "--worker-out", path,
           "--deadline", f"{deadline_wall:.3f}", "--config", args.config, "--device", args.device,
           "--min-seq", str(args.min_seq), "--max-seq", str(args.max_seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--refine", str(args.refine), "--long-step-s", str(args.long_step_s),
           "--fake-oom-tokens", str(args.fake_oom_tokens), "--mask-seqs", args.mask_seqs,
           "--doc-len", str(args.doc_len), "--mask-steps", str(args.mask_steps), "--check-seq", str(args.check_seq),
           *(["--small"] if args.small else []), *sum((["--override", o] for o in args.override), []), *extra]
    why = None
    try:
        # A little grace past the deadline for the child to write its last row; short, so that
        # a --budget-s of 540 still ends inside a 600 s device call.
        proc = subprocess.run(cmd, timeout=max(5.0, deadline_wall - time.time() + 15.0),
                              stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode:
            why = f"child exited with code {proc.returncode}"
    except subprocess.TimeoutExpired:
        why = "killed at the budget's deadline"
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    os.unlink(path)
    return lines, why


def _planned_gib(args, mode: str, T: int) -> float | None:
    """The memory planner's total for ``mode`` at length T (``k3train model-info``), GiB."""
    try:
        # The meta-device model asks for the (one-rank) parallel groups; gloo: no CUDA context here.
        init_distributed(device="cpu")
        cfg = load_config(args.config, [*_base_overrides(args, T), *_mode_overrides(mode), "data.document_mask=false"])
        cpu = args.device == "cpu"
        ops = "torch" if cpu else "fused-eager" if cfg.kernels.compile is False else "fused"
        plans = plan_memory(cfg, ops=ops, act_bytes=4 if cpu or cfg.precision.recipe == "fp32" else 2)
        return max(p.total(cfg.train.recompute, False) for p in plans) / GiB
    except Exception as exc:   # a figure for comparison only: the measurement must not fail on it
        return f"planner failed: {exc}"[:120]


def _fmt(v, spec: str, missing: str = "-") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else missing


def format_tables(result: dict) -> str:
    lines = [f"capacity on {result['device']}, {result['config']}, one sequence per microbatch "
             f"(budget {result['budget_s']:.0f} s, used {result.get('used_s', 0):.0f} s)"]
    chk = result.get("offload_check")
    if chk:
        lines.append(f"offload check at {chk.get('seq_len')} tokens: {'PASS' if chk.get('pass') else 'FAIL'} "
                     f"(largest loss/gradient difference, offload {chk.get('offload_max_diff')} vs control "
                     f"{chk.get('control_max_diff')}; {_fmt(chk.get('offloaded_gib'), '.2f')} GiB to the host; peak "
                     f"{_fmt(chk.get('peak_gib_full'), '.1f')} -> {_fmt(chk.get('peak_gib_offload'), '.1f')} GiB)"
                     + (f" [{chk['ended']}]" if chk.get("ended") else ""))
    for mode, m in result.get("modes", {}).items():
        lines.append(f"\nrecompute {mode}: longest trained {m.get('longest') or 'none'}"
                     + (f" ({m['ended']})" if m.get("ended") else ""))
        lines.append(f"{'seq_len':>9}{'status':>10}{'tok/s':>10}{'step s':>9}{'peak GiB':>10}{'plan GiB':>10}"
                     f"{'host GiB':>10}  note")
        for r in m["rows"]:
            note = r.get("why") or r.get("error") or ("refined" if r.get("refined") else "")
            lines.append(f"{r['seq_len']:>9}{r['status']:>10}{_fmt(r.get('tokens_per_s'), '10.0f', '         -')}"
                         f"{_fmt(r.get('step_s'), '9.2f', '        -')}{_fmt(r.get('peak_gib'), '10.1f', '         -')}"
                         f"{_fmt(r.get('plan_gib'), '10.1f', '         -')}"
                         f"{_fmt(r.get('host_offloaded_gib'), '10.1f', '         -')}  {note}")
    split = result.get("split")
    if split:
        lines.append("\nisolated layer forward+backward (no recompute): ms, ms per 1K tokens, log-log slope "
                     "(1 linear, 2 quadratic), share of the sum over the model's layers "
                     f"(counts {split.get('counts')})")
        lines.append(f"{'seq_len':>9}" + "".join(f"{n + ' ms':>11}{'/1K':>8}{'slope':>7}" for n in ("kda", "mla", "moe"))
                     + f"{'MLA share':>11}{'KDA share':>11}")
        for r in split["rows"]:
            if r["status"] != "ok":
                lines.append(f"{r['seq_len']:>9}  {r['status']}: {r.get('why', '')}")
                continue
            cells = ""
            for n in ("kda", "mla", "moe"):
                ms = r["ms"].get(n)
                cells += (f"{_fmt(ms, '11.1f', '          -')}{_fmt(ms and ms / r['seq_len'] * 1024, '8.3f', '       -')}"
                          f"{_fmt(r.get('slope', {}).get(n), '7.2f', '      -')}")
            lines.append(f"{r['seq_len']:>9}{cells}{_fmt(r.get('share', {}).get('mla'), '11.1%', '          -')}"
                         f"{_fmt(r.get('share', {}).get('kda'), '11.1%', '          -')}")
    mask = result.get("mask")
    if mask:
        lines.append("\ndocument masking (one sequence per microbatch, recompute none): tokens/s")
        lines.append(f"{'seq_len':>9}{'doc_len':>9}{'unmasked eager':>16}{'masked eager':>14}{'unmasked graphed':>18}"
                     f"{'masked/unmasked eager':>23}{'masked/graphed':>16}")
        for seq, r in mask["by_seq"].items():
            cells = ""
            for name, width in (("unmasked_eager", 16), ("masked_eager", 14), ("unmasked_graphed", 18)):
                v = r["rows"].get(name, {})
                cells += (f"{v['tokens_per_s']:>{width}.0f}" if v.get("status") == "ok"
                          else f"{v.get('status', '-'):>{width}}")
            lines.append(f"{seq:>9}{r['doc_len']:>9}{cells}{_fmt(r.get('masked_over_unmasked_eager'), '23.3f', ' ' * 22 + '-')}"
                         f"{_fmt(r.get('masked_over_graphed'), '16.3f', ' ' * 15 + '-')}")
    for s in result.get("skipped_parts", []):
        lines.append(f"skipped: {s}")
    return "\n".join(lines)


def _summarise_split(lines: list[dict]) -> dict:
    counts = next((x["counts"] for x in lines if "counts" in x), {})
    rows = [x for x in lines if "seq_len" in x]
    ok = [r for r in rows if r["status"] == "ok"]
    for n in ("kda", "mla", "moe"):
        pts = [(r["seq_len"], r["ms"].get(n)) for r in ok if r["ms"].get(n)]
        for (t, _), s in zip(pts, loglog_slope(pts)):
            next(r for r in ok if r["seq_len"] == t).setdefault("slope", {})[n] = s
    for r in ok:
        tot = {n: (r["ms"].get(n) or 0.0) * counts.get(n, 0) for n in ("kda", "mla", "moe")}
        s = sum(tot.values())
        if s > 0 and all(r["ms"].get(n) is not None for n in tot if counts.get(n)):
            r["share"] = {n: v / s for n, v in tot.items()}
    return {"counts": counts, "rows": rows}


def _summarise_mask(lines: list[dict]) -> dict:
    by_seq: dict = {}
    for x in lines:
        e = by_seq.setdefault(x["seq_len"], {"doc_len": x["doc_len"], "rows": {}})
        e["rows"][x["row"]] = {k: v for k, v in x.items() if k not in ("seq_len", "doc_len", "row")}
    for e in by_seq.values():
        tok = {k: v.get("tokens_per_s") for k, v in e["rows"].items() if v.get("status") == "ok"}
        if "masked_eager" in tok and "unmasked_eager" in tok:
            e["masked_over_unmasked_eager"] = tok["masked_eager"] / tok["unmasked_eager"]
        if "masked_eager" in tok and "unmasked_graphed" in tok:
            e["masked_over_graphed"] = tok["masked_eager"] / tok["unmasked_graphed"]
    return {"by_seq": by_seq}


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU dry run)")
    ap.add_argument("--modes", default="none,selective,full,full+offload",
                    help="comma list of none, selective, full, each optionally +offload")
    ap.add_argument("--parts", default="modes,split,mask", help="comma list of check, modes, split, mask")
    ap.add_argument("--one-child", action="store_true",
                    help="run every mode in one child process, the model built once (for the K3 slice); "
                         "default: a child per mode")
    ap.add_argument("--min-seq", type=int, default=4096)
    ap.add_argument("--max-seq", type=int, default=1048576)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per length (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--long-step-s", type=float, default=20.0, help="a step longer than this is timed once")
    ap.add_argument("--refine", type=int, default=0, help="bisection steps past the longest power of two")
    ap.add_argument("--check-seq", type=int, default=16384, help="the offload check's sequence length")
    ap.add_argument("--mask-seqs", default="4096,32768")
    ap.add_argument("--doc-len", type=int, default=0, help="masking rows' document length (default seq/4)")
    ap.add_argument("--mask-steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall seconds for everything")
    ap.add_argument("--quick", action="store_true", help="4K..32K, one timed step, masking at 4K only")
    ap.add_argument("--fake-oom-tokens", type=int, default=0,
                    help="dry runs: treat a length above this as out of memory (0: off)")
    ap.add_argument("--override", action="append", default=[], help="extra config override (repeatable)")
    ap.add_argument("--json")
    # Internal: a child's role.
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--lengths", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        {"split": worker_split, "mask": worker_mask, "check": worker_check}.get(args.worker, worker_mode)(args)
        return None
    if args.quick:
        args.max_seq = min(args.max_seq, 8 * args.min_seq)
        args.steps, args.refine = 1, 0
        args.mask_seqs = args.mask_seqs.split(",")[0]
    t_start = time.time()
    end = t_start + args.budget_s
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        _mode_overrides(m)   # a bad mode fails here, before any child starts
    parts = [p for p in args.parts.split(",") if p]
    slice_like = "slice" in args.config or "full" in os.path.basename(args.config)
    setup = SLICE_SETUP_S if slice_like else SETUP_S
    # The parent never touches CUDA (a context of its own would take memory from the children):
    # the device's name comes from the first child.
    result = {"device": args.device,
              "config": args.config, "budget_s": args.budget_s, "modes": {}, "skipped_parts": [],
              "args": {k: v for k, v in vars(args).items() if not k.startswith("worker") and k != "deadline"}}
    # Shares of what is left, so that a part that finishes early leaves its time to the next:
    # the split and the masking rows keep a reserve while the modes run.
    reserve = {"split": 0.12 * args.budget_s if "split" in parts else 0.0,
               # six trainer builds (two lengths x three rows): more of the budget without modes
               "mask": (0.18 if "modes" in parts else 0.4) * args.budget_s if "mask" in parts else 0.0}
    if "check" in parts:
        lines, why = _child(args, "check", min(end, time.time() + 240), [])
        result["offload_check"] = dict(lines[-1] if lines else {}, ended=why)
        print(f"offload check: {result['offload_check']}", flush=True)
        save_json(args.json, result)
    if "modes" in parts and args.one_child:
        # One child for every mode: the model is built once (the K3 slice's build takes minutes).
        left = end - time.time() - sum(reserve.values())
        lines, why = _child(args, ",".join(modes), time.time() + left, [])
        head = next((x for x in lines if "setup_s" in x), {})
        result["device"] = head.get("device", result["device"])
        for mode in modes:
            rows = [{k: v for k, v in x.items() if k != "mode"} for x in lines if x.get("mode") == mode]
            for r in rows:
                if r["status"] in ("ok", "oom"):
                    r["plan_gib"] = _planned_gib(args, mode, r["seq_len"])
            ended = why if rows and rows[-1]["status"] not in ("oom", "not tried") else None
            result["modes"][mode] = {"rows": rows, "longest": longest(rows), "ended": ended, **head}
        save_json(args.json, result)
    elif "modes" in parts:
        for i, mode in enumerate(modes):
            left = end - time.time() - sum(reserve.values())
            share = left / (len(modes) - i)
            # The last modes (full, +offload) go furthest: give each an equal share of what is
            # left, and what an earlier mode leaves carries on to the later ones.
            if share < setup:
                result["modes"][mode] = {"rows": [], "ended": f"skipped: {share:.0f} s left for it, setup alone takes ~{setup:.0f} s"}
                result["skipped_parts"].append(f"mode {mode}: no time left")
                continue
            lines, why = _child(args, mode, time.time() + share, [])
            head = next((x for x in lines if "setup_s" in x), {})
            rows = [{k: v for k, v in x.items() if k != "mode"} for x in lines if "seq_len" in x]
            for r in rows:
                if r["status"] in ("ok", "oom"):
                    r["plan_gib"] = _planned_gib(args, mode, r["seq_len"])
            result["modes"][mode] = {"rows": rows, "longest": longest(rows), "ended": why, **head}
            result["device"] = head.get("device", result["device"])
            print(f"mode {mode}: longest {longest(rows)}" + (f" ({why})" if why else ""), flush=True)
            save_json(args.json, result)
    if "split" in parts:
        reserve["split"] = 0.0
        reached = [m["longest"] for m in result["modes"].values() if m.get("longest")]
        top = max(reached) if reached else (args.max_seq if "modes" not in parts else None)
        left = end - time.time() - sum(reserve.values())
        if top is None:
            result["skipped_parts"].append("split: no mode trained any length")
        elif left < 30:
            result["skipped_parts"].append(f"split: {left:.0f} s left")
        else:
            lengths = doubling_lengths(args.min_seq, top)
            lines, why = _child(args, "split", time.time() + left, ["--lengths", ",".join(map(str, lengths))])
            result["split"] = dict(_summarise_split(lines), ended=why)
            save_json(args.json, result)
    if "mask" in parts:
        reserve["mask"] = 0.0
        left = end - time.time()
        if left < 30:
            result["skipped_parts"].append(f"mask: {left:.0f} s left")
        else:
            lines, why = _child(args, "mask", time.time() + left, [])
            result["mask"] = dict(_summarise_mask(lines), ended=why)
    result["used_s"] = time.time() - t_start
    save_json(args.json, result)
    print(format_tables(result), flush=True)
    return result


if __name__ == "__main__":
    main()
