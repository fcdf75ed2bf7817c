"""The trainer's graphed document-masked step against its eager step, on one GPU.

Two runs of ``k3train train`` on the same config, seed and batches, with document masking
(``data.document_mask=true``, the built-in corpus's documents): ``train.cuda_graph=false`` and
``train.cuda_graph=true`` (the graph records the fixed-shape boundaries from step 3,
``k3train.trainer.cuda_graph.CapturedDocuments``). Per logged step, the training losses of the
two runs, compared. Gate (exit 0): every step's loss within ``--tol`` (2e-2 relative: bf16, and the
graphed run's kernels see padded boundaries, the same arithmetic on the same tokens), the
graphed run's banner says the graph is on with document boundaries, and both runs learn (last
loss below the first).

    python scripts/gpu_check_graphed_documents.py [--config configs/k3_mini.yaml] [--steps 30] [--json OUT]
    python scripts/gpu_check_graphed_documents.py --device cpu --config configs/k3_tiny.yaml --steps 4  # dry run (both eager)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(config: str, run_dir: Path, graph: str, args) -> tuple[list[dict], str]:
    """One training run -> (metrics.jsonl records, its output)."""
    cmd = [sys.executable, "-m", "k3train", "train", "--config", config, "--run-dir", str(run_dir),
           f"train.steps={args.steps}", "train.log_interval=1", f"train.eval_interval={args.steps}",
           "data.document_mask=true", f"train.cuda_graph={graph}", f"train.device={args.device}",
           f"train.seq_len={args.seq_len}", "checkpoint.interval=0", "logging.wandb.mode=disabled",
           "logging.progress_bar=false", "train.plots=false", "kernels.autotune=fixed", *args.overrides]
    out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"train.cuda_graph={graph} failed (exit {out.returncode}):\n{text[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--device", default="cuda", help="cpu dry-runs the script (both runs eager)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = ap.parse_args()
    graphed = "true" if args.device == "cuda" else "false"
    with tempfile.TemporaryDirectory() as tmp:
        eager, _ = run(args.config, Path(tmp) / "eager", "false", args)
        graph, text = run(args.config, Path(tmp) / "graphed", graphed, args)
    banner = next((line for line in text.splitlines() if "cuda graphs:" in line), "")
    rows = [{"step": a["step"], "eager": a["loss"], "graphed": b["loss"],
             "rel": abs(a["loss"] - b["loss"]) / abs(a["loss"])} for a, b in zip(eager, graph)]
    worst = max(r["rel"] for r in rows)
    learns = all(r[-1]["loss"] < r[0]["loss"] for r in (eager, graph))
    on = args.device != "cuda" or ("on (" in banner and "document boundaries" in banner)
    ok = worst <= args.tol and learns and on and len(rows) == len(eager) == len(graph)
    for r in rows:
        print(f"step {r['step']:>4}  eager {r['eager']:.5f}  graphed {r['graphed']:.5f}  rel {r['rel']:.2e}")
    print(banner.strip())
    print(f"{'PASS' if ok else 'FAIL'}: worst relative loss difference {worst:.2e} (tol {args.tol:g}), "
          f"both learn: {learns}, graph on with document boundaries: {on}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "banner": banner, "pass": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
