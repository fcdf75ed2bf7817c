"""Per-op costs of the 2x H200 pipeline benchmark's model measured on ONE GPU, replayed by the
timing model, next to the 2x H200 figures measured before the p2p fixes.

    python3 -m benchmarks.predict_pipeline --json OUT [--device cuda] [--steps 3] [--small]
        [--layers-per-chunk K] [key=value ...]

The model is benchmarks/bench_pipeline.py's (hidden 2048, seq 4096, 16 layers KKKM, m=8).
The engine runs eagerly at P = 1 with K layers per chunk (default 1; each chunk's time split
over its layers by FLOPs), and its CommRecorder times every op (CUDA events); one more step
per variant runs under torch.profiler, and the "measured" line gives the CUDA kernels' share of
its chunk spans (spans longer than their kernels are host launch time). The prediction
then covers P x V x m and K3's shapes (``k3train predict-pipeline``). The PP=2 rows
are printed beside the measured 2x H200 figures (docs/pipeline_timing_model.md): if the eager
per-op costs account for the measured steps, the remaining gap is the per-message host cost
the p2p fix removes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny widths: a CPU smoke run of the script")
    ap.add_argument("--layers-per-chunk", type=int, default=1,
                    help="time chunks of K layers (K divides 16), each split over its layers by FLOPs")
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value",
                    help="extra config overrides, e.g. kernels.autotune=fixed on a fresh machine")
    args = ap.parse_args()
    from benchmarks.account_h200_pipeline import MEASURED_MS
    from benchmarks.bench_pipeline import BASE, SMALL

    from k3train.config import load_config
    from k3train.runtime.cuda_env import prepare_cuda_env
    from k3train.profiling.predict import run_predict

    cfg = load_config(str(ROOT / "configs/k3_tiny.yaml"),
                      [*BASE, *(SMALL if args.small else []), f"train.device={args.device}", *args.overrides])
    prepare_cuda_env(cfg)
    report = run_predict(cfg, args.json, steps=args.steps, layers_per_chunk=args.layers_per_chunk)
    rows = {(r["P"], r["V"], r["m"]): r for r in report["table"]}
    print(f"\nPP=2 m=8 from one-GPU eager op costs, against 2x H200 measured (before the p2p fixes)")
    print(f"{'variant':<16}{'V':>3}{'predicted ms':>14}{'measured ms':>13}{'pred/meas':>11}")
    for variant in ("standard", "attnres_cached", "attnres_naive"):
        for V in (1, 2, 4):
            pred = rows[(2, V, 8)][f"{variant}_ms"]
            meas = MEASURED_MS[variant][V]
            print(f"{variant:<16}{V:>3}{pred:>14.1f}{meas:>13.1f}{pred / meas:>11.2f}")


if __name__ == "__main__":
    main()
