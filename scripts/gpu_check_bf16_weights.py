"""The memory layouts of docs/memory.md#layouts on one GPU: fp32 weights against bf16 weights.

Trains ``--config`` (default configs/k3_slice.yaml) for ``--steps`` steps on the same data once
per layout, each in a fresh process (so ``torch.cuda.max_memory_allocated`` is that layout's
alone), with ZeRO-1 off and CUDA graphs off (bf16 weights refuse them; off for all, so the
layouts differ in nothing else):

* ``fp32``: ``precision.param_dtype=fp32`` (today: fp32 weights, gradients and moments);
* ``bf16``: ``precision.param_dtype=bf16`` (bf16 weights, fp32 main_grad and main parameters,
  fp32 moments);
* ``bf16_state``: ``precision.param_dtype=bf16 optim.state_dtype=bf16`` (moments in bf16).

Prints the losses side by side, each layout's peak allocated memory (GiB) and the bytes per
parameter docs/memory.md predicts for its model states, and JSON (``--json``, and
``$OUT/bf16_weights.json`` when ``OUT`` is set). No checkpoint is written.

PASS: every step finite in every layout, and each bf16 layout's mean loss over the last 5
steps within ``--tol`` (default 0.05 nats) of the fp32 run's (bf16 autocast computes the same
GEMMs in every layout; only the rounding of the weights and moments differs). Exit 1 otherwise.

    python scripts/gpu_check_bf16_weights.py [--config configs/k3_slice.yaml] [--steps 30]
        [--microbatches 4] [--layouts fp32,bf16,bf16_state] [--tol 0.05] [--json OUT]

Expected runtime on one H200 with the slice: about 2-3 minutes per layout (kernel compilation
and autotuning, then ~1 s per step at 4 x 4096 tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from k3train.config import load_config
from k3train.trainer.loop import Trainer

warnings.filterwarnings("ignore")

LAYOUTS = {
    "fp32": ["precision.param_dtype=fp32", "optim.state_dtype=fp32"],
    "bf16": ["precision.param_dtype=bf16", "optim.state_dtype=fp32"],
    "bf16_state": ["precision.param_dtype=bf16", "optim.state_dtype=bf16"],
}


class NoSaveTrainer(Trainer):
    def _save(self, step: int) -> None:  # a K3 slice checkpoint is tens of GB: not wanted here
        pass


def child(args) -> None:
    """One layout's run in this process: the trainer's set-up and loop, without checkpoints."""
    overrides = [*LAYOUTS[args.layout], f"train.steps={args.steps}", f"train.microbatches={args.microbatches}",
                 "train.log_interval=1", f"train.eval_interval={10 * args.steps}", "train.cuda_graph=false",
                 "optim.zero1=false", "logging.wandb.mode=disabled", "logging.progress_bar=false"]
    cfg = load_config(args.config, overrides)
    run_dir = Path(args.run_dir)
    trainer = NoSaveTrainer(cfg, run_dir)
    trainer.set_up()
    trainer.run_loop()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    opt = trainer.state.optimizer
    n_params = sum(p.numel() for p in trainer.state.params)
    out = {"layout": args.layout, "losses": [r["loss"] for r in records if "loss" in r],
           "skipped": sum(r.get("skipped", 0) for r in records),
           "tokens_per_s": [r["tokens_per_s"] for r in records][-5:],
           # 0 off CUDA (the script's CPU smoke run): nothing to measure there.
           "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
           "parameters": n_params, "optimizer": type(opt).__name__,
           "weight_dtype": str(trainer.state.params[0].dtype)}
    Path(args.result).write_text(json.dumps(out))


def predicted_bytes_per_param(layout: str, optim_name: str) -> str:
    """docs/memory.md#layouts: weights + gradient buffer + main parameters + moments (AdamW two,
    Muon one moment: a range between them, the slice's matrices being on Muon)."""
    weights, grad = (4, 4) if layout == "fp32" else (2, 4)
    main = 0 if layout == "fp32" else 4
    moment = 2 if layout == "bf16_state" else 4
    adamw, muon = weights + grad + main + 2 * moment, weights + grad + main + moment
    return f"{muon}-{adamw} B" if optim_name == "muon" else f"{adamw} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_slice.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--layouts", default="fp32,bf16,bf16_state")
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--json")
    ap.add_argument("--layout", help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layout:
        child(args)
        return 0

    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        print(f"--layouts: unknown {unknown}; allowed: {', '.join(LAYOUTS)}")
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in layouts:
            result = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--layout", name, "--config", args.config, "--steps", str(args.steps),
                   "--microbatches", str(args.microbatches), "--run-dir", str(Path(tmp) / name),
                   "--result", str(result)]
            print(f"[bf16-weights] {name}: {' '.join(LAYOUTS[name])}", flush=True)
            proc = subprocess.run(cmd)
            if proc.returncode != 0 or not result.exists():
                print(f"[bf16-weights] {name}: the run failed (exit {proc.returncode})")
                results[name] = {"failed": True}
                continue
            results[name] = json.loads(result.read_text())

    optim_name = load_config(args.config, []).optim.name
    ok_runs = [n for n in layouts if not results[n].get("failed")]
    print("\nstep  " + "".join(f"{n:>14}" for n in ok_runs))
    for i in range(max((len(results[n]["losses"]) for n in ok_runs), default=0)):
        print(f"{i + 1:>4}  " + "".join(f"{results[n]['losses'][i]:>14.4f}" if i < len(results[n]["losses"])
                                        else f"{'':>14}" for n in ok_runs))
    print("\nlayout        max_memory_allocated  model-state bytes/param (docs)  tokens/s (last 5)")
    for n in ok_runs:
        r = results[n]
        tps = sum(r["tokens_per_s"]) / max(len(r["tokens_per_s"]), 1)
        print(f"{n:<12}  {r['max_memory_allocated_gib']:>17.2f} GiB  {predicted_bytes_per_param(n, optim_name):>30}"
              f"  {tps:>16.0f}")

    failures = [f"{n}: run failed" for n in layouts if results[n].get("failed")]
    failures += [f"{n}: {results[n]['skipped']} non-finite steps" for n in ok_runs if results[n]["skipped"]]
    if "fp32" in ok_runs:
        ref = results["fp32"]["losses"][-5:]
        for n in ok_runs:
            if n == "fp32":
                continue
            mine = results[n]["losses"][-5:]
            diff = abs(sum(mine) / len(mine) - sum(ref) / len(ref))
            results[n]["last5_loss_diff_vs_fp32"] = diff
            print(f"{n}: mean loss of the last 5 steps differs from fp32's by {diff:.4f} (tolerance {args.tol})")
            if diff > args.tol:
                failures.append(f"{n}: last-5 mean loss {diff:.4f} from fp32's, over {args.tol}")
    summary = {"config": args.config, "steps": args.steps, "microbatches": args.microbatches,
               "tol": args.tol, "results": results, "failures": failures, "pass": not failures}
    for path in filter(None, [args.json, os.environ.get("OUT") and str(Path(os.environ["OUT"]) / "bf16_weights.json")]):
        Path(path).write_text(json.dumps(summary, indent=1))
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
