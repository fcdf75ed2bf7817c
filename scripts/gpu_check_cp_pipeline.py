"""Context parallelism on GPUs (NCCL), alone and under the interleaved pipeline, against the
single-GPU run of the same model and data.

    python scripts/gpu_check_cp_pipeline.py --out DIR [--steps 30] [--only cp2_fp32,pp2_vpp2_cp2]

Each variant is ``k3train train`` on ``configs/k3_tiny.yaml`` under ``torchrun`` on as many GPUs
as its layout needs (cp2: 2; pp2 x vpp2 x cp2: 4), document-masked windows (the default); its
reference is the same command in one process on one GPU with the same global batch. The runner,
the twin-split floor and the tolerances are ``scripts/gpu_parallel_check.py``'s (read its
docstring): fp32 variants (TF32 off) within 2e-5 at step 1 and within max(2e-5, 10 x the twin
floor) at step 2; bf16 variants within 0.02 at step 1 and 0.15 on average; every run learns
(last loss < first - 0.5). Prints one JSON line per variant, exits 1 if any fails.
``--device cpu`` dry-runs the script itself on gloo.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpu_parallel_check import BASE, losses, run, twin_split

MB = ["train.micro_batch_size=8", "train.microbatches=2"]
# variant -> (processes, parallel overrides, reference overrides); 16 sequences per step in both.
VARIANTS = {
    "cp2_fp32": (2, ["parallel.cp=2", *MB], MB),
    "cp2": (2, ["parallel.cp=2", *MB], MB),
    "pp2_vpp2_cp2_fp32": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2", *MB], MB),
    "pp2_vpp2_cp2": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2", *MB], MB),
    "pp2_vpp2_cp2_full_recompute": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2",
                                        "train.recompute=full", *MB], MB),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--run-limit", type=float, default=240, help="seconds before one run counts as hung")
    ap.add_argument("--device", default="cuda", help="cpu dry-runs the script itself (gloo)")
    ap.add_argument("--only", help="comma list of variants (default all): " + ",".join(VARIANTS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--config", "configs/k3_tiny.yaml"]
    steps = [f"train.steps={args.steps}", f"train.eval_interval={args.steps}", f"train.device={args.device}"]
    refs: dict[tuple, list[float]] = {}

    def reference(overrides: list[str]) -> list[float]:
        key = tuple(sorted(overrides))
        if key not in refs:
            rdir = out / f"ref_{len(refs)}"
            run([sys.executable, "-m", "k3train", "train", *common, "--run-dir", str(rdir), *BASE, *steps,
                 *overrides], out / f"ref_{len(refs)}.log", args.run_limit)
            refs[key] = losses(rdir)
        return refs[key]

    ok = True
    for name in (args.only.split(",") if args.only else VARIANTS):
        nproc, par, ref = VARIANTS[name]
        fp32 = name.endswith("_fp32")
        if fp32:
            par, ref = [*par, "precision.recipe=fp32"], [*ref, "precision.recipe=fp32"]
        try:
            want = reference(ref)
            pdir = out / name
            secs = run(["torchrun", "--standalone", "--nproc-per-node", str(nproc), "-m", "k3train", "train",
                        *common, "--run-dir", str(pdir), *BASE, *steps, *par], out / f"{name}.log", args.run_limit)
            got = losses(pdir)
            diffs = [abs(a - b) for a, b in zip(got, want)]
            row = {"variant": name, "gpus": nproc, "seconds": round(secs), "steps": len(got),
                   "step1_diff": diffs[0], "step2_diff": diffs[1], "mean_diff": sum(diffs) / len(diffs),
                   "first_loss": got[0], "last_loss": got[-1], "ref_last_loss": want[-1]}
            if fp32:
                twin = reference(twin_split(ref))
                row["twin_step2_floor"] = abs(twin[1] - want[1])
                close = row["step1_diff"] < 2e-5 and row["step2_diff"] < max(2e-5, 10 * row["twin_step2_floor"])
            else:
                close = row["step1_diff"] < 0.02 and row["mean_diff"] < 0.15
            row["ok"] = len(got) == len(want) == args.steps and close and got[-1] < got[0] - 0.5
        except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
            row = {"variant": name, "ok": False, "error": str(exc)}
        ok &= row["ok"]
        print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
