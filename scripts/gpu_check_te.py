"""Transformer Engine as the fp8 backend on one GPU, side by side with bf16 and torchao.

    PYTHONPATH=/tmp/site_te:/tmp/site:$PWD python3 scripts/gpu_check_te.py \\
        [--config configs/k3_mini.yaml] [--steps 100] [--recipes current,delayed,blockwise] [--json OUT]

(on a lent machine, ``tools/te_device.sh`` installs Transformer Engine 2.20.2 into /tmp/site_te
first, and the tests need pytest: its wheels beside the others in /tmp/site). What it does, each training run through the ``k3train train`` command as a user runs it,
from the same seed and the same batches:

1. the TE-gated tests, ``tests/quant/test_te_backend.py`` (state dict equal to bf16's, strict
   loads both ways, loss against bf16, per recipe);
2. ``--steps`` steps of ``--config`` under bf16, torchao fp8 and TE fp8 with each recipe in
   ``--recipes`` (one the GPU or the installed TE lacks is reported with its one-line refusal);
   ``train.cuda_graph=false`` in every run (the TE backend is not validated under capture, so
   the others run eagerly too, for a like-for-like tokens/s), ``optim`` as in the config;
3. the first TE run's checkpoint at step ``steps // 2`` resumed under TE (same recipe), torchao
   and bf16: the loss of the next step against the TE run's own loss at that step.

PASS (exit 0) when: the tests pass (skips allowed only for a recipe this GPU lacks); each run's
mean loss over its last 10 steps is within ``FINAL_TOL`` (2% relative) of bf16's; the resumed
next-step loss is within ``RESUME_TOL`` (1% relative; TE -> TE 0.2%) of the TE run's. Prints a
table of losses (every ``steps // 10`` steps) and tokens/s (median over the run's second half);
writes everything to ``--json`` (default ``$OUT/gpu_check_te.json`` when ``$OUT`` is set).
Budget: k3_mini (16K tokens per step, about 1B parameters; the K3 slice's 6.5B parameters take
too long to build and initialise five times over) runs eagerly at about 0.4 s per step on one
H200, and each run first compiles its Triton kernels (about a minute for the first, from the
cache after): five runs of 200 steps, three resumes and the tests come to about 12 minutes, so
the default is 100 steps (about 8 minutes); ``--steps 200`` is the issue's full length.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FINAL_TOL = 0.02     # relative, mean loss of the last 10 steps against bf16's
RESUME_TOL = 0.01    # relative, resumed next-step loss against the TE run's own, other backends
SAME_TOL = 0.002     # relative, TE -> TE (same recipe, same weights, same batch)
RECIPES = ("current", "delayed", "blockwise")
ROOT = Path(__file__).resolve().parent.parent


def variant_overrides(variant: str) -> list[str]:
    if variant == "bf16":
        return ["precision.recipe=bf16"]
    if variant == "torchao":
        return ["precision.recipe=fp8", "precision.fp8_backend=torchao"]
    return ["precision.recipe=fp8", "precision.fp8_backend=te", f"precision.fp8_recipe={variant[3:]}"]


def train(config: str, run_dir: Path, overrides: list[str], resume: bool = False, timeout: int = 600) -> dict:
    """One ``k3train train`` process; returns its metrics records, wall time and output tail."""
    cmd = [sys.executable, "-m", "k3train", "train", "--config", config, "--run-dir", str(run_dir),
           *(["--resume"] if resume else []), *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    out = {"rc": proc.returncode, "wall_s": round(wall, 1), "records": records}
    if proc.returncode:
        out["error"] = (proc.stdout + proc.stderr).strip().splitlines()[-1:] + [
            line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line][-3:]
    return out


def summarise(run: dict) -> dict:
    recs = [r for r in run["records"] if "loss" in r]
    if not recs:
        return {}
    half = recs[len(recs) // 2:]
    return {"losses": {r["step"]: r["loss"] for r in recs},
            "final_mean10": statistics.fmean(r["loss"] for r in recs[-10:]),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in half),
            "memory_gib": max(r.get("memory_gib", 0.0) for r in recs)}


def run_tests(env: dict) -> dict:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"rc": 1, "tail": ["pytest is not importable: install its wheel (pytest, pluggy, iniconfig, "
                                  "packaging) into /tmp/site, or pass --skip-tests"]}
    # -rfEs and --tb=line: the first run on an H200 (2026-12-04) printed "3 failed" and, with
    # -rs alone, not which three; the whole output also goes to $OUT when that is set.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "--tb=line", "-p", "no:cacheprovider",
                           "tests/quant/test_te_backend.py"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "te_tests.log").write_text(proc.stdout + proc.stderr)
    tail = proc.stdout.strip().splitlines()[-40:]
    return {"rc": proc.returncode, "tail": tail}


def resume_from(src: Path, step: int, dst: Path) -> None:
    """A fresh run directory holding only ``src``'s checkpoint of ``step`` (hard links: the
    resumed run writes new step directories and never edits these files)."""
    name = f"step_{step:08d}"
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name, copy_function=os.link)
    (dst / "checkpoints" / "latest").write_text(name + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "gpu_check_te.json") if os.environ.get("OUT") else None)
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    bad = sorted(set(recipes) - set(RECIPES))
    if bad or not recipes:
        raise SystemExit(f"--recipes: unknown {bad}; allowed: {','.join(RECIPES)}")
    if args.steps < 20:
        raise SystemExit("--steps must be at least 20 (the final mean takes the last 10, the resume the middle)")
    try:
        import transformer_engine.pytorch as te
        import torch
        te_version = getattr(sys.modules["transformer_engine"], "__version__", "unknown")
        device = torch.cuda.get_device_name()
    except Exception as exc:  # noqa: BLE001 - report any import failure in one line
        raise SystemExit(f"Transformer Engine is not importable ({type(exc).__name__}: {exc}); on a lent "
                         f"machine run tools/te_device.sh fetch/receive/install and put /tmp/site_te on PYTHONPATH")
    del te
    env = dict(os.environ)
    report = {"config": args.config, "steps": args.steps, "recipes": recipes, "device": device,
              "transformer_engine": te_version, "tolerances": {"final": FINAL_TOL, "resume": RESUME_TOL,
                                                                "te_to_te": SAME_TOL}}
    t_start = time.time()
    if not args.skip_tests:
        report["tests"] = run_tests(env)
        print("\n".join(report["tests"]["tail"]), flush=True)
    half = args.steps // 2
    common = [f"train.steps={args.steps}", "train.log_interval=1", f"train.eval_interval={10 * args.steps}",
              "train.cuda_graph=false", "logging.wandb.mode=disabled", "logging.progress_bar=false",
              "checkpoint.interval=0"]
    variants = ["bf16", "torchao", *(f"te_{r}" for r in recipes)]
    runs, fails = {}, []
    with tempfile.TemporaryDirectory(prefix="gpu_check_te_") as tmp:
        tmp = Path(tmp)
        first_te = None
        for v in variants:
            extra = []
            if v.startswith("te_") and first_te is None:
                extra = [f"checkpoint.interval={half}", "checkpoint.keep_last=4"]
            run = train(args.config, tmp / v, [*common, *variant_overrides(v), *extra])
            runs[v] = {"rc": run["rc"], "wall_s": run["wall_s"], **summarise(run)}
            if run["rc"]:
                runs[v]["error"] = run["error"]
            elif v.startswith("te_") and first_te is None:
                first_te = v
            print(f"{v:<13} rc={run['rc']} {run['wall_s']:6.1f} s  "
                  + (f"final {runs[v]['final_mean10']:.4f}  {runs[v]['tokens_per_s']:9.0f} tok/s"
                     if "final_mean10" in runs[v] else f"{run.get('error')}"), flush=True)
        resumes = {}
        if first_te is not None:
            for target in (first_te, "torchao", "bf16"):
                dst = tmp / f"resume_{first_te}_to_{target}"
                resume_from(tmp / first_te, half, dst)
                run = train(args.config, dst, [*common, f"train.steps={half + 1}", *variant_overrides(target)],
                            resume=True)
                got = {r["step"]: r["loss"] for r in run["records"]}.get(half + 1)
                want = runs[first_te]["losses"].get(half + 1)
                tol = SAME_TOL if target == first_te else RESUME_TOL
                ok = run["rc"] == 0 and got is not None and abs(got - want) <= tol * abs(want)
                resumes[f"{first_te}->{target}"] = {"rc": run["rc"], "step": half + 1, "loss": got,
                                                    "te_run_loss": want, "tolerance": tol, "ok": ok,
                                                    **({"error": run["error"]} if run["rc"] else {})}
                print(f"resume {first_te} step {half} -> {target}: step {half + 1} loss {got} vs {want} "
                      f"({'ok' if ok else 'FAIL'})", flush=True)
                if not ok:
                    fails.append(f"resume {first_te}->{target}")
        else:
            fails.append("no TE run finished: nothing to resume")
    report["runs"], report["resumes"] = runs, resumes
    base = runs.get("bf16", {})
    if "final_mean10" not in base:
        fails.append("bf16 run failed")
    print(f"\n{'step':>6} " + "".join(f"{v:>13}" for v in variants))
    every = max(args.steps // 10, 1)
    for step in range(every, args.steps + 1, every):
        print(f"{step:>6} " + "".join(f"{runs[v].get('losses', {}).get(step, float('nan')):13.4f}" for v in variants))
    print(f"{'last10':>6} " + "".join(f"{runs[v].get('final_mean10', float('nan')):13.4f}" for v in variants))
    print(f"{'tok/s':>6} " + "".join(f"{runs[v].get('tokens_per_s', float('nan')):13.0f}" for v in variants))
    print(f"{'x bf16':>6} " + "".join(f"{runs[v].get('tokens_per_s', float('nan')) / base.get('tokens_per_s', float('nan')):13.3f}"
                                       for v in variants))
    for v in variants:
        r = runs[v]
        if "final_mean10" not in r:
            # A recipe this GPU or TE lacks is refused in one line: reported, not a failure.
            refused = any("does not run here" in line for line in r.get("error", []))
            r["refused"] = refused
            if not refused:
                fails.append(f"{v} failed")
            continue
        if "final_mean10" in base:
            r["final_rel_diff_vs_bf16"] = (r["final_mean10"] - base["final_mean10"]) / base["final_mean10"]
            r["speedup_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
            if abs(r["final_rel_diff_vs_bf16"]) > FINAL_TOL:
                fails.append(f"{v} final loss {r['final_rel_diff_vs_bf16']:+.3%} from bf16")
    tests = report.get("tests")
    if tests is not None and tests["rc"] != 0:
        fails.append("tests/quant/test_te_backend.py failed")
    report["wall_s"] = round(time.time() - t_start, 1)
    report["fails"], report["pass"] = fails, not fails
    for v in runs.values():   # the per-step losses stay, keyed by str for JSON
        if "losses" in v:
            v["losses"] = {str(k): x for k, x in v["losses"].items()}
    print(f"\n{'PASS' if not fails else 'FAIL: ' + '; '.join(fails)} ({report['wall_s']:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
