"""Start-up and fixed costs of ``k3train train``: wall time from launch to the first step and to
"done", as a user sees them, and the import time of the trainer.

    python3 -m benchmarks.bench_startup --config configs/k3_tiny.yaml --reps 5 \
        --set train.device=cpu train.steps=2 train.eval_interval=2      # CPU (2 steps, 1 evaluation)
    python3 -m benchmarks.bench_startup --config configs/k3_mini.yaml --reps 1 --set train.steps=120
        # one fresh H200: the issue's "prints done within 90 s of launch" (caches cold on the first rep)
    python3 -m benchmarks.bench_startup --tree /tmp/base ...            # the same for another source tree

Each repetition launches ``python -m k3train train --config CONFIG --run-dir <fresh tmp dir>
OVERRIDES`` as a subprocess (``PYTHONPATH`` = ``--tree``, ``OMP_NUM_THREADS`` as set here) and
stamps its output as it arrives: ``first_step_s`` is the launch-to-first progress-bar update
(``1/N``; the run's set-up, compile-ahead and step 1 included), ``done_s`` the launch-to-"done"
line, ``exit_s`` the process's exit. ``import_s`` is ``python -c "import k3train.trainer.loop"``
and ``help_s`` ``python -m k3train train --help``, each in a fresh interpreter. Reported: every
repetition and the medians (the machine may be shared: the median, not the mean).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import save_json

_FIRST = re.compile(r"\|\s*1/\d+")


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _wall(cmd: list[str], tree: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=tree, env=_env(tree), check=True, capture_output=True)
    return time.perf_counter() - t0


def _train_once(tree: Path, config: str, overrides: list[str]) -> dict:
    """One ``train`` run's stamps (seconds from launch)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "k3train", "train", "--config", config, "--run-dir",
               str(Path(tmp) / "r"), *overrides]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        first = done = None
        piece, tail = b"", []
        while True:
            ch = proc.stdout.read(1)
            if not ch:
                break
            if ch in (b"\r", b"\n"):
                text = piece.decode(errors="replace")
                tail = (tail + [text])[-20:]
                if first is None and _FIRST.search(text):
                    first = time.perf_counter() - t0
                if done is None and "[k3train] done" in text:
                    done = time.perf_counter() - t0
                piece = b""
            else:
                piece += ch
        code = proc.wait()
        exit_s = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"train exited with {code}:\n" + "\n".join(tail))
    return {"first_step_s": first, "done_s": done, "exit_s": exit_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3_tiny.yaml")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides (key=value)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tree", default=".", help="source tree to run (its k3train/ wins on PYTHONPATH)")
    ap.add_argument("--json", default=None, help="write the result dict here")
    args = ap.parse_args(argv)
    tree = Path(args.tree).resolve()
    rows = []
    for rep in range(args.reps):
        row = {"import_s": _wall([sys.executable, "-c", "import k3train.trainer.loop"], tree),
               "help_s": _wall([sys.executable, "-m", "k3train", "train", "--help"], tree),
               **_train_once(tree, args.config, args.set)}
        rows.append(row)
        print(f"rep {rep + 1}: " + "  ".join(f"{k} {v:.2f}" if v is not None else f"{k} n/a"
                                              for k, v in row.items()), flush=True)
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0] if all(r[k] is not None for r in rows)}
    print("median: " + "  ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    save_json(args.json, {"tree": str(tree), "config": args.config, "overrides": args.set, "reps": rows,
                          "median": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
