"""Time to the first training step on a fresh machine: ``k3train train`` with empty Triton and
Inductor caches, as a new user's first run (~200 s of Triton compiles on k3_mini, then
Dynamo's recompile limit for ``rms_norm_eager``).

    python3 -m benchmarks.bench_first_step --json first_step.json            # one GPU, ~2-3 min
    python3 -m benchmarks.bench_first_step --autotune fixed --json f.json    # one candidate each
    python3 -m benchmarks.bench_first_step --save-picks picks.json kernels.autotune_picks=none  # tune all, keep the picks
    python3 -m benchmarks.bench_first_step --device cpu --small --timeout 120  # CPU dry run

Launches ``python -m k3train train --config CONFIG`` in a subprocess with ``TRITON_CACHE_DIR``
and ``TORCHINDUCTOR_CACHE_DIR`` in a new temp dir (nothing compiled before; fla's autotune
results, kept by Triton in its cache dir, start empty too) and ``TORCH_LOGS=recompiles`` (Dynamo
prints every recompile with its guard failure). Reports seconds from launch to: the
compile-ahead pass's end (its own "compiled N Triton kernels in S s" line), step 1's and step
3's metrics records (RUN_DIR/metrics.jsonl; step 3 includes an evaluation pass), plus every
recompile and recompile-limit line seen. The run is killed after step 3's record (no checkpoint
is written) or at ``--timeout``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.hidden_size=64", "model.num_layers=4", "model.kda.num_heads=2", "model.kda.head_dim=32",
         "model.mla.num_heads=2", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
         "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16",
         "model.ffn.intermediate_size=128", "moe.num_experts=4", "moe.topk=2", "moe.latent_size=32",
         "moe.expert_ffn_size=32", "moe.shared_ffn_size=64", "train.seq_len=32", "train.micro_batch_size=2"]
RECOMPILE = re.compile(r"recompil|cache_size_limit", re.I)
LIMIT = re.compile(r"recompile_limit|cache_size_limit", re.I)
COMPILED = re.compile(r"compiled (\d+) Triton kernels in ([\d.]+) s")


def first_steps(metrics: Path) -> list[int]:
    """The steps RUN_DIR/metrics.jsonl has records of so far (a half-written line is skipped)."""
    if not metrics.exists():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU dry run)")
    ap.add_argument("--autotune", default="full", choices=["full", "fixed"], help="kernels.autotune")
    ap.add_argument("--timeout", type=float, default=170.0, help="seconds before the run is killed")
    ap.add_argument("--stacks", type=float, default=0.0, metavar="S",
                    help="print every thread's Python stack in the run every S seconds (what a silent wait is; "
                         "benchmarks/stack_sampler.py)")
    ap.add_argument("--save-picks", metavar="PATH",
                    help="copy the run's RUN_DIR/autotune_picks.json (written after step 1) to PATH: "
                         "the file a later run reads with kernels.autotune_picks=PATH, or ships as "
                         "k3train/ops/autotune_data/<gpu>.json")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="k3train_first_step_"))
    run_dir = tmp / "run"
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp / "triton"), TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
               TORCH_LOGS="recompiles", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    launcher = [sys.executable, "-m", "k3train"]
    if args.stacks > 0:  # every thread's stack under the GIL (faulthandler's C dump crashed the run)
        launcher = [sys.executable, str(ROOT / "benchmarks/stack_sampler.py"), str(args.stacks), "-m", "k3train"]
    cmd = [*launcher, "train", "--config", args.config, "--run-dir", str(run_dir),
           *(SMALL if args.small else []), f"train.device={args.device}", "train.steps=3", "train.log_interval=1",
           "train.eval_interval=3", "train.eval_batches=1", "checkpoint.interval=0", "logging.progress_bar=false",
           "logging.wandb.mode=disabled", f"kernels.autotune={args.autotune}", *args.overrides]
    print(f"[bench_first_step] caches in {tmp}\n[bench_first_step] {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def pump():
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))
            print(f"{lines[-1][0]:7.1f}s | {lines[-1][1]}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    seen: dict[int, float] = {}
    while proc.poll() is None and time.perf_counter() - t0 < args.timeout and 3 not in seen:
        for step in first_steps(run_dir / "metrics.jsonl"):
            seen.setdefault(step, time.perf_counter() - t0)
        time.sleep(0.2)
    for step in first_steps(run_dir / "metrics.jsonl"):
        seen.setdefault(step, time.perf_counter() - t0)
    killed = proc.poll() is None
    if killed:  # our own child (its own session): stop it, no checkpoint needed
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(timeout=5)

    compiled = [(t, COMPILED.search(text)) for t, text in lines if COMPILED.search(text)]
    recompiles = [text for _, text in lines if RECOMPILE.search(text)]
    result = {"config": args.config, "autotune": args.autotune, "device": args.device, "timeout_s": args.timeout,
              "seconds_to_step": {str(k): v for k, v in sorted(seen.items())},
              "compile_ahead_end_s": compiled[0][0] if compiled else None,
              "compile_ahead": ({"kernels": int(compiled[0][1][1]), "seconds": float(compiled[0][1][2])}
                                if compiled else None),
              "recompile_lines": recompiles[:50], "recompile_limit_hit": any(LIMIT.search(r) for r in recompiles),
              "exit_code": proc.returncode, "reached_step_1": 1 in seen,
              "died_of_signal": (signal.Signals(-proc.returncode).name
                                 if proc.returncode < 0 and not killed else None)}
    kernels_json = run_dir / "kernels.json"
    result["autotune_picks_in_force"] = (json.loads(kernels_json.read_text()).get("autotune_picks")
                                         if kernels_json.is_file() else None)
    picks = run_dir / "autotune_picks.json"
    if args.save_picks:
        if picks.is_file():
            Path(args.save_picks).write_text(picks.read_text())
            print(f"[bench_first_step] autotune picks copied to {args.save_picks}")
        else:
            print("[bench_first_step] the run wrote no autotune_picks.json (no full-autotune CUDA step 1)")
    print("\nfirst step on fresh caches:", args.config, f"(kernels.autotune={args.autotune})")
    print(f"  autotune picks read:  {result['autotune_picks_in_force'] or 'none (every kernel tuned)'}")
    ca, ca_end = result["compile_ahead"], result["compile_ahead_end_s"]
    print("  compile-ahead:        " + ("-" if ca is None else f"{ca['kernels']} kernels, ends at {ca_end:.1f} s"))
    for step in (1, 2, 3):
        t = seen.get(step)
        print(f"  step {step} logged at:     {'not reached within %.0f s' % args.timeout if t is None else f'{t:.1f} s'}")
    if result["died_of_signal"]:
        print(f"  the run died of signal {result['died_of_signal']} before step 3 (not killed by this script)")
    print(f"  recompile log lines:  {len(recompiles)}; recompile limit hit: {result['recompile_limit_hit']}")
    for text in recompiles[:10]:
        print(f"    {text[:200]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if 1 in seen else 1


if __name__ == "__main__":
    sys.exit(main())
