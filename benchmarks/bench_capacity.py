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
  (``data.document_mask=true``), and both again with ``train.cuda_graph=auto`` (graphed where the
  trainer graphs: what a user gets; masked windows are graphed below 16K tokens), same batches,
  recompute none (``benchmarks.bench_step.ours``). masked / unmasked graphed is the masking cost
  a user sees; masked / unmasked eager is the same without graphs. ``--mask-rows`` picks rows.

Budget: every part and every length is skipped, and said so in the table and the JSON, when
what is left of ``--budget-s`` cannot hold it (the time of the next length is predicted from the
last two, a T + b T^2); a child is killed at its deadline. ``--quick``: 4K to 32K, one timed step,
no refinement, masking at 4K only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

from benchmarks.capacity_search import doubling_lengths, loglog_slope, longest
from benchmarks.capacity_workers import (GiB, base_overrides, mode_overrides, worker_check, worker_mask,
                                         worker_mode, worker_split)
from benchmarks.common import save_json
from k3train.config import load_config
from k3train.profiling.memory_plan import plan_memory
from k3train.runtime.distributed import init_distributed

warnings.filterwarnings("ignore")

# A child's fixed costs beyond its lengths (building the model on the host, compiling the
# kernels), used to decide whether a mode still fits the budget; measured on k3_mini.
SETUP_S = 45.0
SLICE_SETUP_S = 150.0


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
           "--mask-rows", args.mask_rows,
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
        cfg = load_config(args.config, [*base_overrides(args, T), *mode_overrides(mode), "data.document_mask=false"])
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
                     f"{'masked graphed':>16}{'masked/unmasked eager':>23}{'masked/unmasked graphed':>25}")
        for seq, r in mask["by_seq"].items():
            cells = ""
            for name, width in (("unmasked_eager", 16), ("masked_eager", 14), ("unmasked_graphed", 18),
                                ("masked_graphed", 16)):
                v = r["rows"].get(name, {})
                cells += (f"{v['tokens_per_s']:>{width}.0f}" if v.get("status") == "ok"
                          else f"{v.get('status', '-'):>{width}}")
            lines.append(f"{seq:>9}{r['doc_len']:>9}{cells}{_fmt(r.get('masked_over_unmasked_eager'), '23.3f', ' ' * 22 + '-')}"
                         f"{_fmt(r.get('masked_over_unmasked_graphed'), '25.3f', ' ' * 24 + '-')}")
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
        if "masked_graphed" in tok and "unmasked_graphed" in tok:
            # the masking cost a user sees: both graphed where the trainer graphs them
            e["masked_over_unmasked_graphed"] = tok["masked_graphed"] / tok["unmasked_graphed"]
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
    ap.add_argument("--mask-rows", default="", help="comma list of the masking rows to run (default all: "
                    "unmasked_eager, masked_eager, unmasked_graphed, masked_graphed)")
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
        mode_overrides(m)   # a bad mode fails here, before any child starts
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
