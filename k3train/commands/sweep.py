"""Run an ablation file's variants one after another (resumable), each in OUT/<variant>/, then
write results.md, results.csv and the loss (and MaxVio) curves. See docs/ablations.md."""
from __future__ import annotations

HELP = "run an ablation file's variants one after another; tabulate and plot"


def add_arguments(p) -> None:
    p.add_argument("ablation", help="ablation file, e.g. configs/ablations/attnres.yaml")
    p.add_argument("--out", help="output directory (default runs/sweeps/<sweep name>)")
    p.add_argument("--dry-run", action="store_true", help="resolve and list the variants without training")
    p.add_argument("--seeds", metavar="S1,S2,...",
                   help="run every variant once per train.seed (replaces the file's 'seeds'); results.md "
                        "then adds mean and standard deviation over seeds")
    p.add_argument("--only", metavar="NAME,...", help="train and tabulate only these variants (as --dry-run lists them; a variant's name without _seed-S takes all its seeds)")
    p.add_argument("--jobs", type=int, default=1,
                   help="variants trained at once, each in its own process (default 1: one after another)")
    p.add_argument("--collect", action="store_true",
                   help="train nothing: tabulate the variants finished in --out and name the others")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="overrides applied to every variant, after the file's own")


def run(args) -> int:
    """0: every variant done; EXIT_SWEEP_STOPPED (3): a stop signal ended it with variants left
    (rerun to resume); 2 (the CLI): refused."""
    import sys

    from k3train.sweep.runner import EXIT_SWEEP_STOPPED, SweepStopped, run_sweep

    try:
        run_sweep(args.ablation, args.out, args.overrides, dry_run=args.dry_run, seeds=args.seeds,
                  only=args.only, jobs=args.jobs, collect=args.collect)
    except SweepStopped as exc:
        print(f"k3train: {exc}", file=sys.stderr)
        return EXIT_SWEEP_STOPPED
    return 0
