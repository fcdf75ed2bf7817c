"""The pipeline timing model's one benchmark, in three modes.

    python3 -m benchmarks.timing_model check [--pp 2,4] [--vpp 2] [--microbatches 8] [--json OUT]
    python3 -m benchmarks.timing_model account [--json OUT]
    python3 -m benchmarks.timing_model gpu --json OUT [--device cuda] [--steps 3] [--small] [--layers-per-chunk K]
    python3 -m benchmarks.timing_model graphs [--measured RESULTS.json] [--json OUT]
    python3 -m benchmarks.timing_model cp [--json OUT]

``check``: the model against the real engine on CPU (gloo), at P = 2 and P = 4. For each P: (1)
per-chunk forward/backward times of the P*V chunks, measured on one process (the engine at P = 1,
V = P*V); (2) the same, measured in P concurrent copies, so that each copy sees the CPU
contention the P pipeline ranks will; (3) the real engine at P ranks under torchrun/gloo, whose
own compute spans give a third set of op times. It prints measured, the three predictions and
their errors, and the load average (the machine may be shared).

``account``: the 2x H200 pipeline figures (measured before the p2p fixes) accounted for by the
model from the one-GPU dense step's FLOP rate; runs on CPU in seconds, nothing is measured.

``gpu``: per-op costs of the 2x H200 pipeline benchmark's model measured on ONE GPU (the engine
at P = 1, K layers per chunk, CommRecorder spans), replayed by the model next to the measured
2x H200 figures (``k3train predict-pipeline`` gives the whole P x V x m table).

``graphs``: PREDICTED per-GPU throughput of k3_mini at PP = 2, 4, 8 x V = 2 on H200, with chunk
graphs and eager, from the one-GPU engine's measured step times (``benchmarks.bench_chunk_graphs``
at P = 1, V = 2, m = 8): each side's seconds per FLOP scales the per-layer FLOPs into per-chunk
op costs, the H200 link carries the engine's own message bytes, and the schedule is replayed.
Each row sets the predicted per-GPU tokens/s against the one-GPU graphed step's times the
textbook bubble factor 1 / (1 + (P - 1) / (V m)) (target: >= 0.90). CPU, seconds.

``cp``: PREDICTED context parallelism for K3 at 128K and 1M tokens with CP = 4, 8, 16 on H200:
one K3 rank's layers (``configs/k3_slice.yaml``: K3's widths, one EP rank's experts, 3 KDA : 1
MLA), compute from the slice's measured forward+backward rate on one H200 (431.7 TFLOP/s:
58.5% of the 738 TFLOP/s matmul rate measured in that run, benchmarks/2026-12-02_all_figures-page.md),
the most loaded rank's causal attention pairs under the contiguous partition and under
head-tail, and communication from the CP byte formula (``k3train.ops.context_parallel``, each
partition's own: head-tail sends two [E, M] per KDA layer and up to two halos) over NVLink
(CP <= 8, one node) or 50 GB/s per GPU between nodes (CP = 16). CPU, seconds.

See docs/pipeline_timing_model.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3train.config import load_config
from k3train.model.flops import flops_breakdown, flops_per_token
from k3train.ops.context_parallel import causal_pairs_per_rank, cp_bytes_per_rank
from k3train.profiling.predict import (H200_LINK, chunk_costs, flop_scaled_layer_costs, format_table, layout_messages,
                                       measure_chunk_times, predict_table, run_predict, variant_config)
from k3train.runtime.cuda_env import prepare_cuda_env
from k3train.runtime.distributed import init_distributed, parallel_context
from k3train.trainer.parts import build_parts

ROOT = Path(__file__).resolve().parents[1]

# k3_tiny's shape (8 layers KKKM, hidden 256, MoE, AttnRes blocks of 2) with fewer tokens per
# microbatch, so that a step with m=8 takes a few seconds on a shared core.
OVERRIDES = ["train.micro_batch_size=2", "train.seq_len=64", "logging.wandb.mode=disabled",
             "logging.progress_bar=false", "train.device=cpu"]


def _cfg(args, pp: int, vpp: int, transport: str = "cached"):

    return load_config(str(ROOT / "configs/k3_tiny.yaml"),
                       [*OVERRIDES, f"train.microbatches={args.microbatches}", f"parallel.pp={pp}",
                        f"parallel.vpp={vpp}", f"pipeline.attnres_transport={transport}"])


def measure_worker(args) -> None:
    """One process: per-chunk times at P = 1 with ``args.chunks`` chunks."""
    import torch

    torch.set_num_threads(1)

    f, b = measure_chunk_times(_cfg(args, 1, 1), args.chunks, steps=args.steps, warmup=2)
    Path(args.out).write_text(json.dumps({"fwd_s": f, "bwd_s": b}))


def engine_worker(args) -> None:
    """Under torchrun: the real engine at P = WORLD_SIZE, V = args.vpp; rank 0 writes step times."""
    import torch

    torch.set_num_threads(1)
    from pipeline import CommRecorder

    P = int(os.environ["WORLD_SIZE"])
    cfg = _cfg(args, P, args.vpp)
    info = init_distributed(1, P, args.vpp, 1, "cpu")
    torch.manual_seed(0)
    recorder = CommRecorder()
    _chunks, engine = build_parts(cfg, torch.device("cpu"), parallel_context(info), recorder)
    B, T, m = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.train.microbatches
    gen = torch.Generator().manual_seed(0)        # the same tokens on every rank
    times = []
    for step in range(2 + args.steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (m, B, T + 1), generator=gen)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.train_step([(t[:, :-1], t[:, 1:]) for t in tokens])
        # The step ends when the slowest rank ends: a barrier, then rank 0's clock.
        torch.distributed.barrier()
        if step >= 2:
            times.append(time.perf_counter() - t0)
        for ch in _chunks.values():
            ch.zero_grad(set_to_none=True)
    # The op times of the run itself (the compute spans of the timed steps, all ranks): the
    # model's inputs under exactly the run's contention.
    spans = [s for s in recorder.compute if s.step >= 2]
    recorder.gather()
    if info.rank == 0:
        spans = [s for s in recorder.compute if s.step >= 2]
        C = P * args.vpp
        # Means, not medians: the step is a sum of op times, and an op the OS preempted (the
        # machine is shared) costs the step its whole time.
        mean = {k: [statistics.mean(s.end - s.start for s in spans if s.kind == k and s.chunk == c)
                    for c in range(C)] for k in "FB"}
        med = {k: [statistics.median(s.end - s.start for s in spans if s.kind == k and s.chunk == c)
                   for c in range(C)] for k in "FB"}
        Path(args.out).write_text(json.dumps({"step_s": times, "fwd_s": mean["F"], "bwd_s": mean["B"],
                                              "fwd_median_s": med["F"], "bwd_median_s": med["B"],
                                              "bubble": recorder.bubble_fraction()["measured"]}))
    torch.distributed.destroy_process_group()


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}


def _measure(args, chunks: int, copies: int, tmp: Path) -> list[dict]:
    outs = [tmp / f"costs_{chunks}_{copies}_{i}.json" for i in range(copies)]
    procs = [subprocess.Popen([sys.executable, __file__, "check", "--measure-worker", "--chunks", str(chunks),
                               "--steps", str(args.steps), "--microbatches", str(args.microbatches),
                               "--out", str(o)], env=_env(), stdout=subprocess.DEVNULL)
             for o in outs]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"measurement worker failed (rc {p.returncode})")
    return [json.loads(o.read_text()) for o in outs]


def _run_engine(args, P: int, tmp: Path) -> list[float]:
    out = tmp / f"engine_{P}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={P}", __file__,
           "check", "--engine-worker", "--vpp", str(args.vpp), "--steps", str(args.steps),
           "--microbatches", str(args.microbatches), "--out", str(out)]
    if subprocess.run(cmd, env=_env(), stdout=subprocess.DEVNULL).returncode != 0:
        raise SystemExit(f"engine run at P={P} failed")
    return json.loads(out.read_text())


def _mean_costs(runs: list[dict]):
    from pipeline.timing_model import OpCosts

    n = len(runs[0]["fwd_s"])
    return OpCosts(tuple(statistics.mean(r["fwd_s"][c] for r in runs) for c in range(n)),
                   tuple(statistics.mean(r["bwd_s"][c] for r in runs) for c in range(n)))


def check_main(args) -> None:
    if args.measure_worker:
        return measure_worker(args)
    if args.engine_worker:
        return engine_worker(args)

    from pipeline.timing_model import LinkCost, OpCosts, predict_step

    # gloo on localhost: a few tens of microseconds and ~1-2 GB/s through the host; the
    # messages here are small (hidden 2 x 128 x 256 fp32 = 256 KiB), so the link barely matters.
    link = LinkCost(latency_s=50e-6, bandwidth_Bps=1.5e9)
    rows = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for P in map(int, args.pp.split(",")):
            C = P * args.vpp
            t0 = time.perf_counter()
            run = _run_engine(args, P, tmp)
            alone = in_run = _mean_costs([run])
            contended = in_run
            if not args.run_only:
                alone = _mean_costs(_measure(args, C, 1, tmp))
                contended = _mean_costs(_measure(args, C, P, tmp))
            measured = run["step_s"]
            msgs = layout_messages(_cfg(args, P, args.vpp), P, args.vpp)
            pred_alone = predict_step(P, args.vpp, args.microbatches, alone, msgs, link)
            pred_cont = predict_step(P, args.vpp, args.microbatches, contended, msgs, link)
            pred_run = predict_step(P, args.vpp, args.microbatches, in_run, msgs, link)
            meas = statistics.median(measured)
            row = {"P": P, "V": args.vpp, "m": args.microbatches, "cores": os.cpu_count(),
                   "load_avg_1min": os.getloadavg()[0],
                   "measured_s": meas, "measured_all_s": measured, "measured_bubble": run["bubble"],
                   "predicted_alone_s": pred_alone.step_s, "predicted_contended_s": pred_cont.step_s,
                   "predicted_in_run_s": pred_run.step_s,
                   "error_alone": pred_alone.step_s / meas - 1, "error_contended": pred_cont.step_s / meas - 1,
                   "error_in_run": pred_run.step_s / meas - 1,
                   "bubble_predicted": pred_cont.bubble, "bubble_predicted_in_run": pred_run.bubble,
                   "chunk_fwd_ms_alone": [x * 1e3 for x in alone.fwd_s],
                   "chunk_bwd_ms_alone": [x * 1e3 for x in alone.bwd_s],
                   "chunk_fwd_ms_contended": [x * 1e3 for x in contended.fwd_s],
                   "chunk_bwd_ms_contended": [x * 1e3 for x in contended.bwd_s],
                   "chunk_fwd_ms_in_run": [x * 1e3 for x in in_run.fwd_s],
                   "chunk_bwd_ms_in_run": [x * 1e3 for x in in_run.bwd_s]}
            row["_in_run"], row["_msgs"] = in_run, msgs
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith(("chunk", "_"))}), flush=True)
            print(f"  (P={P} took {time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{'P':>3}{'V':>3}{'m':>4}{'measured s':>12}{'pred (alone)':>14}{'error':>8}"
          f"{'pred (P copies)':>17}{'error':>8}{'pred (run ops)':>16}{'error':>8}{'load':>6}")
    for r in rows:
        print(f"{r['P']:>3}{r['V']:>3}{r['m']:>4}{r['measured_s']:>12.3f}{r['predicted_alone_s']:>14.3f}"
              f"{r['error_alone']:>+8.1%}{r['predicted_contended_s']:>17.3f}{r['error_contended']:>+8.1%}"
              f"{r['predicted_in_run_s']:>16.3f}{r['error_in_run']:>+8.1%}{r['load_avg_1min']:>6.1f}")
    # What the run-ops prediction lacks is a cost per received message: on a shared, oversubscribed
    # CPU a rank blocked in a gloo receive waits for the OS to run it again. Fit it on the first
    # P, predict the others with it.
    if len(rows) > 1:
        first = rows[0]

        def with_wakeup(r, h):
            costs = OpCosts(r["_in_run"].fwd_s, r["_in_run"].bwd_s, recv_overhead_s=h)
            return predict_step(r["P"], r["V"], r["m"], costs, r["_msgs"], link).step_s

        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if with_wakeup(first, mid) < first["measured_s"] else (lo, mid)
        h = (lo + hi) / 2
        print(f"\nfitted on P={first['P']}: {h * 1e3:.1f} ms per received message (OS wake-up under load)")
        for r in rows:
            r["wakeup_s"] = h
            r["predicted_in_run_wakeup_s"] = with_wakeup(r, h)
            r["error_in_run_wakeup"] = r["predicted_in_run_wakeup_s"] / r["measured_s"] - 1
            print(f"P={r['P']}: measured {r['measured_s']:.3f} s, run ops + wake-up "
                  f"{r['predicted_in_run_wakeup_s']:.3f} s ({r['error_in_run_wakeup']:+.1%})"
                  + (" (fitted)" if r is first else ""))
    for r in rows:
        r.pop("_in_run"), r.pop("_msgs")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


MEASURED_MS = {"standard": {1: 794.4, 2: 854.3, 4: 914.7},          # benchmarks/README.md, cfa8d57
               "attnres_cached": {1: 946.2, 2: 1035.1, 4: 1116.4},
               "attnres_naive": {1: 943.1, 2: 1050.8, 4: 1142.5}}
ONE_GPU = {"standard": (100.6 - 3.0) * 1e-3, "attnres": (104.9 - 3.1) * 1e-3}   # fwd+bwd s per step
M, P = 8, 2


def account_main(args) -> None:
    from benchmarks.bench_pipeline import BASE

    from pipeline.timing_model import predict_step

    mini = load_config(str(ROOT / "configs/k3_mini.yaml"),
                       ["model.layer_pattern=K", "model.dense_layers=16", "optim.name=adamw"])
    bench = load_config(str(ROOT / "configs/k3_tiny.yaml"), BASE)
    tokens = 8 * 2048
    # Seconds per FLOP on one H200, per variant (AttnRes carries its measured +4% at the same FLOPs).
    rate = {"standard": ONE_GPU["standard"] / (tokens * flops_per_token(variant_config(mini, "standard"))),
            "attnres": ONE_GPU["attnres"] / (tokens * flops_per_token(variant_config(mini, "attnres_cached")))}
    print(f"one-GPU rate: standard {1 / rate['standard'] / 1e12:.0f} TFLOP/s, "
          f"AttnRes {1 / rate['attnres'] / 1e12:.0f} TFLOP/s (fwd+bwd)")

    def predict(variant: str, V: int, k: float = 1.0, h: float = 0.0):
        """Step with compute times x k and a host cost h per received message."""
        cfg = variant_config(bench, variant)
        spf = k * rate["standard" if variant == "standard" else "attnres"]
        costs = chunk_costs(flop_scaled_layer_costs(cfg, spf), cfg.model.num_layers, P * V,
                            recv_overhead_s=h)
        return predict_step(P, V, M, costs, layout_messages(cfg, P, V), H200_LINK)

    def linear(variant: str, V: int) -> tuple[float, float]:
        """(A, B) with step ~= k * A + h * B near k = 1, h = 0 (the schedule's critical path)."""
        a = predict(variant, V).step_s
        return a, (predict(variant, V, 1.0, 1e-3).step_s - a) / 1e-3

    # Two effects the FLOP-scaled model lacks, fitted on the standard residual at V=1 and V=2:
    # k, the eager step's slowdown over the graphed one-GPU rate (host-bound launches), and h,
    # a fixed host cost per received message. V=4 and the AttnRes rows are then predictions,
    # except k_attn, AttnRes's own eager factor, fitted on the cached V=1 row alone.
    (a1, b1), (a2, b2) = linear("standard", 1), linear("standard", 2)
    t1, t2 = MEASURED_MS["standard"][1] * 1e-3, MEASURED_MS["standard"][2] * 1e-3
    det = a1 * b2 - a2 * b1
    k, h = (t1 * b2 - t2 * b1) / det, (a1 * t2 - a2 * t1) / det
    a, b = linear("attnres_cached", 1)
    k_attn = (MEASURED_MS["attnres_cached"][1] * 1e-3 - h * b) / a
    fitted = {"standard": k, "attnres_cached": k_attn, "attnres_naive": k_attn}
    rows = []
    for variant in MEASURED_MS:
        for V in (1, 2, 4):
            base, fit = predict(variant, V), predict(variant, V, fitted[variant], h)
            p2p_fixed = predict(variant, V, fitted[variant], 0.0)      # eager compute, no per-message cost
            meas = MEASURED_MS[variant][V]
            rows.append({"variant": variant, "V": V, "measured_ms": meas, "model_ms": base.step_s * 1e3,
                         "model_error": base.step_s * 1e3 / meas - 1, "bubble": base.bubble,
                         "fitted_ms": fit.step_s * 1e3, "fitted_error": fit.step_s * 1e3 / meas - 1,
                         "fitted_bubble": fit.bubble, "p2p_fixed_ms": p2p_fixed.step_s * 1e3,
                         "in_sample": (variant, V) in (("standard", 1), ("standard", 2), ("attnres_cached", 1)),
                         "messages_rank0": sum(1 for op, _, _ in base.spans[0]
                                               if (op.kind == "F" and op.chunk > 0)
                                               or (op.kind == "B" and op.chunk < P * V - 1))})
    std = {r["V"]: r for r in rows if r["variant"] == "standard"}
    print(f"fitted: compute x {k:.2f} (standard), x {k_attn:.2f} (AttnRes; = +{k_attn / k - 1:.1%} over "
          f"standard's), host cost per received message {h * 1e3:.2f} ms\n")
    print(f"{'variant':<16}{'V':>3}{'msgs':>5}{'measured':>10}{'vs std':>8}{'model':>8}{'err':>8}{'vs std':>8}"
          f"{'fitted':>9}{'err':>8}{'vs std':>8}{'no msg cost':>12}{'vs std':>8}")
    for r in rows:
        s = std[r["V"]]
        r["measured_vs_standard"] = r["measured_ms"] / s["measured_ms"] - 1
        r["model_vs_standard"] = r["model_ms"] / s["model_ms"] - 1
        r["fitted_vs_standard"] = r["fitted_ms"] / s["fitted_ms"] - 1
        r["p2p_fixed_vs_standard"] = r["p2p_fixed_ms"] / s["p2p_fixed_ms"] - 1
        mark = "*" if r["in_sample"] else " "
        print(f"{r['variant']:<16}{r['V']:>3}{r['messages_rank0']:>5}{r['measured_ms']:>10.1f}"
              f"{r['measured_vs_standard']:>+8.1%}{r['model_ms']:>8.1f}"
              f"{r['model_error']:>+8.1%}{r['model_vs_standard']:>+8.1%}{r['fitted_ms']:>8.1f}{mark}"
              f"{r['fitted_error']:>+8.1%}{r['fitted_vs_standard']:>+8.1%}{r['p2p_fixed_ms']:>12.1f}"
              f"{r['p2p_fixed_vs_standard']:>+8.1%}")
    print("(* fitted rows; the others are predictions. model: FLOP-scaled one-GPU compute + link, i.e. "
          "after both fixes; no msg cost: the eager factor kept, the per-message cost removed)")
    report = {"compute_factor_standard": k, "compute_factor_attnres": k_attn, "recv_cost_s": h, "rows": rows}

    # K3's real shapes at the one-GPU (graphed) rates, free of the two effects above: PREDICTED.
    k3 = load_config(str(ROOT / "configs/k3_full.yaml"))
    k3_costs = {v: flop_scaled_layer_costs(variant_config(k3, v), rate["standard" if v == "standard" else "attnres"])
                for v in ("standard", "attnres_cached", "attnres_naive")}
    report["k3_table"] = predict_table(k3, k3_costs, H200_LINK, grid=((16,), (1, 2, 4), (16, 32, 64)))
    print()
    print(format_table(report["k3_table"], f"PREDICTED, configs/k3_full.yaml (hidden {k3.model.hidden_size}, "
                                           f"{k3.model.num_layers} layers, AttnRes blocks of {k3.model.attnres.block_size}, "
                                           f"seq {k3.train.seq_len}, micro-batch {k3.train.micro_batch_size}) at the "
                                           "one-GPU rates, P=16",
                       unit="s"))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def gpu_main(args) -> None:
    from benchmarks.bench_pipeline import BASE, SMALL


    cfg = load_config(str(ROOT / "configs/k3_tiny.yaml"),
                      [*BASE, *(SMALL if args.small else []), f"train.device={args.device}", *args.overrides])
    prepare_cuda_env(cfg)
    report = run_predict(cfg, args.json, steps=args.steps, layers_per_chunk=args.layers_per_chunk)
    rows = {(r["P"], r["V"], r["m"]): r for r in report["table"]}
    print("\nPP=2 m=8 from one-GPU eager op costs, against 2x H200 measured (before the p2p fixes)")
    print(f"{'variant':<16}{'V':>3}{'predicted ms':>14}{'measured ms':>13}{'pred/meas':>11}")
    for variant in ("standard", "attnres_cached", "attnres_naive"):
        for V in (1, 2, 4):
            pred = rows[(2, V, 8)][f"{variant}_ms"]
            meas = MEASURED_MS[variant][V]
            print(f"{variant:<16}{V:>3}{pred:>14.1f}{meas:>13.1f}{pred / meas:>11.2f}")


SLICE_RATE = 0.585 * 738e12        # the slice's fwd+bwd FLOP/s on one H200 (module docstring)
INTER_NODE_BPS = 50e9              # 400 Gb/s per GPU between nodes


def cp_main(args) -> None:

    cfg = load_config(str(ROOT / "configs/k3_slice.yaml"))
    m = cfg.model
    kinds = [c for c in (m.layer_pattern * m.num_layers)[:m.num_layers]]
    n_kda, n_mla = kinds.count("K"), kinds.count("M")
    a, k = m.mla, m.kda
    per_pair = 3 * 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)  # fwd+bwd
    rows = []
    print(f"PREDICTED: one K3 rank ({m.num_layers} layers: {n_kda} KDA + {n_mla} MLA, K3's widths) per CP rank, "
          f"micro-batch 1, fwd+bwd at {SLICE_RATE / 1e12:.0f} TFLOP/s")
    print(f"{'tokens':>8}{'cp':>4}{'compute s':>11}{'of which attn':>15}{'head-tail s':>13}{'comm s':>9}"
          f"{'ht comm s':>11}{'link':>9}{'comm/compute':>14}{'step s (overlap)':>18}")
    for T in (131072, 1048576):
        base = flops_breakdown(cfg, seq_len=T)
        linear = base["total"] - base["mla_attention"]       # per token, independent of T
        for cp in (4, 8, 16):
            n = T // cp
            worst = max(causal_pairs_per_rank(T, cp, "contiguous"))
            balanced = max(causal_pairs_per_rank(T, cp, "head_tail"))
            attn, attn_ht = n_mla * per_pair * worst, n_mla * per_pair * balanced
            compute = (linear * n + attn) / SLICE_RATE
            compute_ht = (linear * n + attn_ht) / SLICE_RATE
            def sent_by(rank: int, partition: str) -> int:
                b = cp_bytes_per_rank(cp=cp, rank=rank, batch=1, local_tokens=n, kda_heads=k.num_heads,
                                      kda_head_dim=k.head_dim, conv_channels=3 * k.num_heads * k.head_dim,
                                      mla_latent_dim=a.kv_lora_rank + a.qk_rope_head_dim, partition=partition)
                return n_kda * (b["kda_fwd"] + b["kda_bwd"] + b["conv_fwd"] + b["conv_bwd"]) \
                    + n_mla * (b["mla_fwd"] + b["mla_bwd"])
            sent = sent_by(cp - 1, "contiguous")
            sent_ht = sent_by(1, "head_tail")  # a middle rank: both halos go to other ranks
            bw = H200_LINK.bandwidth_Bps if cp <= 8 else INTER_NODE_BPS
            comm = sent / bw + 2 * (n_kda + n_mla) * H200_LINK.latency_s
            comm_ht = sent_ht / bw + 2 * (n_kda + n_mla) * H200_LINK.latency_s
            row = {"tokens": T, "cp": cp, "compute_s": compute, "attention_s": attn / SLICE_RATE,
                   "compute_head_tail_s": compute_ht, "comm_s": comm, "bytes_sent": sent,
                   "comm_head_tail_s": comm_ht, "bytes_sent_head_tail": sent_ht,
                   "step_overlapped_head_tail_s": max(compute_ht, comm_ht),
                   "link_GBps": bw / 1e9, "step_no_overlap_s": compute + comm,
                   "step_overlapped_s": max(compute, comm)}
            rows.append(row)
            print(f"{T:>8}{cp:>4}{compute:>11.3f}{attn / SLICE_RATE:>15.3f}{compute_ht:>13.3f}{comm:>9.3f}"
                  f"{comm_ht:>11.3f}"
                  f"{bw / 1e9:>7.0f}GB{comm / compute:>14.3f}{max(compute, comm):>18.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"predicted": True, "rate_flops": SLICE_RATE, "rows": rows}, indent=1))


GRAPHS_MEASURED = ROOT / "benchmarks/results/2026-12-04_h200_chunk-graphs/chunk_graphs.json"


def graphs_main(args) -> None:
    from pipeline.timing_model import predict_step

    measured = json.loads(Path(args.measured).read_text())
    V, m = measured["vpp"], measured["microbatches"]
    cfg = load_config(str(ROOT / measured["config"]), [f"train.micro_batch_size={measured['mbs']}",
                                                       f"train.seq_len={measured['seq']}", "train.device=cuda"])
    tokens = m * measured["mbs"] * measured["seq"]
    rows_in = measured["rows"]
    one_gpu = {"graphs": rows_in[f"engine chunk graphs V={V}"], "eager": rows_in[f"engine eager V={V}"]}
    rate = {k: r["step_ms"] * 1e-3 / (tokens * flops_per_token(cfg)) for k, r in one_gpu.items()}
    base_tput = one_gpu["graphs"]["tokens_per_s"]
    rows = []
    print(f"PREDICTED: {measured['config']} (seq {measured['seq']}, micro-batch {measured['mbs']}, m={m}, V={V}) "
          f"on H200, from one-GPU measured step times ({one_gpu['graphs']['tokens_per_s']:.0f} tokens/s graphed, "
          f"{one_gpu['eager']['tokens_per_s']:.0f} eager)")
    print(f"{'P':>3}{'bubble factor':>15}{'graphs tok/s/GPU':>18}{'vs 1-GPU x factor':>19}"
          f"{'eager tok/s/GPU':>17}{'graphs/eager':>14}")
    for P in (2, 4, 8):
        if cfg.model.num_layers % (P * V):
            continue
        factor = 1 / (1 + (P - 1) / (V * m))
        row = {"P": P, "V": V, "m": m, "bubble_factor": factor}
        for side in ("graphs", "eager"):
            costs = chunk_costs(flop_scaled_layer_costs(cfg, rate[side]), cfg.model.num_layers, P * V)
            pred = predict_step(P, V, m, costs, layout_messages(cfg, P, V, wire_bytes=2), H200_LINK)
            row[f"{side}_step_ms"] = pred.step_s * 1e3
            row[f"{side}_tokens_per_s_per_gpu"] = tokens / pred.step_s / P
        row["graphs_vs_ideal"] = row["graphs_tokens_per_s_per_gpu"] / (base_tput * factor)
        rows.append(row)
        print(f"{P:>3}{factor:>15.3f}{row['graphs_tokens_per_s_per_gpu']:>18.0f}{row['graphs_vs_ideal']:>19.3f}"
              f"{row['eager_tokens_per_s_per_gpu']:>17.0f}"
              f"{row['graphs_tokens_per_s_per_gpu'] / row['eager_tokens_per_s_per_gpu']:>14.2f}")
    if args.json:
        source = Path(args.measured).resolve()
        shown = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
        Path(args.json).write_text(json.dumps({"measured": str(shown), "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description="the pipeline timing model's benchmark (see the module doc)")
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("check", help="the model against the real engine on CPU")
    c.add_argument("--pp", default="2,4")
    c.add_argument("--vpp", type=int, default=2)
    c.add_argument("--microbatches", type=int, default=8)
    c.add_argument("--steps", type=int, default=3, help="timed steps (2 untimed first)")
    c.add_argument("--json")
    c.add_argument("--run-only", action="store_true",
                   help="only the real runs: predict from their own op times (skips the alone and P-copy measurements)")
    c.add_argument("--measure-worker", action="store_true", help=argparse.SUPPRESS)
    c.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    c.add_argument("--chunks", type=int, help=argparse.SUPPRESS)
    c.add_argument("--out", help=argparse.SUPPRESS)
    a = sub.add_parser("account", help="the 2x H200 figures accounted for by the model (CPU, seconds)")
    a.add_argument("--json")
    g = sub.add_parser("gpu", help="one-GPU per-op costs replayed against the 2x H200 figures")
    g.add_argument("--json", required=True)
    g.add_argument("--device", default="cuda")
    g.add_argument("--steps", type=int, default=3)
    g.add_argument("--small", action="store_true", help="tiny widths: a CPU smoke run of the script")
    g.add_argument("--layers-per-chunk", type=int, default=1,
                   help="time chunks of K layers (K divides 16), each split over its layers by FLOPs")
    g.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="extra config overrides, e.g. kernels.autotune=fixed on a fresh machine")
    gr = sub.add_parser("graphs", help="PREDICTED PP=2/4/8 x V=2 with chunk graphs and eager (CPU, seconds)")
    gr.add_argument("--measured", default=str(GRAPHS_MEASURED),
                    help="bench_chunk_graphs JSON with the one-GPU step times")
    gr.add_argument("--json")
    cpp = sub.add_parser("cp", help="PREDICTED K3 context parallelism at 128K and 1M tokens (CPU, seconds)")
    cpp.add_argument("--json")
    args = ap.parse_args()
    {"check": check_main, "account": account_main, "gpu": gpu_main, "graphs": graphs_main,
     "cp": cp_main}[args.mode](args)


if __name__ == "__main__":
    main()
