"""The pipeline timing model against the real engine on CPU (gloo), at P = 2 and P = 4.

    python3 -m benchmarks.check_timing_model [--pp 2,4] [--vpp 2] [--microbatches 8] [--json OUT]

For each P: (1) per-chunk forward/backward times of the P*V chunks, measured on one process
(the engine at P = 1, V = P*V); (2) the same, measured in P concurrent copies, so that each copy
sees the CPU contention the P pipeline ranks will (on a 2-core machine, 4 ranks share 2 cores);
(3) the real engine at P ranks under torchrun/gloo, step time = median of the timed steps (the
engine's train_step only, no optimizer), whose own compute spans give a third set of op times
(the run's exact contention: it checks the schedule replay apart from how the op times were
taken). It prints measured, the three predictions and their errors, and the load average (the
machine may be shared: other processes' load changes every op time).
Every process runs one torch thread, as torchrun's workers do.
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

ROOT = Path(__file__).resolve().parents[2]
# k3_tiny's shape (8 layers KKKM, hidden 256, MoE, AttnRes blocks of 2) with fewer tokens per
# microbatch, so that a step with m=8 takes a few seconds on a shared core.
OVERRIDES = ["train.micro_batch_size=2", "train.seq_len=64", "logging.wandb.mode=disabled",
             "logging.progress_bar=false", "train.device=cpu"]


def _cfg(args, pp: int, vpp: int, transport: str = "cached"):
    from k3train.config import load_config

    return load_config(str(ROOT / "configs/k3_tiny.yaml"),
                       [*OVERRIDES, f"train.microbatches={args.microbatches}", f"parallel.pp={pp}",
                        f"parallel.vpp={vpp}", f"pipeline.attnres_transport={transport}"])


def measure_worker(args) -> None:
    """One process: per-chunk times at P = 1 with ``args.chunks`` chunks."""
    import torch

    torch.set_num_threads(1)
    from k3train.profiling.predict import measure_chunk_times

    f, b = measure_chunk_times(_cfg(args, 1, 1), args.chunks, steps=args.steps, warmup=2)
    Path(args.out).write_text(json.dumps({"fwd_s": f, "bwd_s": b}))


def engine_worker(args) -> None:
    """Under torchrun: the real engine at P = WORLD_SIZE, V = args.vpp; rank 0 writes step times."""
    import torch

    torch.set_num_threads(1)
    from k3train.runtime.distributed import init_distributed, parallel_context
    from k3train.trainer.parts import build_parts
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
    procs = [subprocess.Popen([sys.executable, __file__, "--measure-worker", "--chunks", str(chunks),
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
           "--engine-worker", "--vpp", str(args.vpp), "--steps", str(args.steps),
           "--microbatches", str(args.microbatches), "--out", str(out)]
    if subprocess.run(cmd, env=_env(), stdout=subprocess.DEVNULL).returncode != 0:
        raise SystemExit(f"engine run at P={P} failed")
    return json.loads(out.read_text())


def _mean_costs(runs: list[dict]):
    from pipeline.timing_model import OpCosts

    n = len(runs[0]["fwd_s"])
    return OpCosts(tuple(statistics.mean(r["fwd_s"][c] for r in runs) for c in range(n)),
                   tuple(statistics.mean(r["bwd_s"][c] for r in runs) for c in range(n)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", default="2,4")
    ap.add_argument("--vpp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (2 untimed first)")
    ap.add_argument("--json")
    ap.add_argument("--run-only", action="store_true",
                    help="only the real runs: predict from their own op times (skips the alone and P-copy measurements)")
    ap.add_argument("--measure-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--chunks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_worker:
        return measure_worker(args)
    if args.engine_worker:
        return engine_worker(args)

    from k3train.profiling.predict import layout_messages
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


if __name__ == "__main__":
    main()
