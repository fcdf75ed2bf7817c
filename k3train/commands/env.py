"""k3train's version and commit, each dependency's version against its tested range, CUDA and
Triton, and the kernel backend each op family will use (for --config's kernels: section).
See docs/dependencies.md and docs/kernels.md."""
from __future__ import annotations

HELP = ("k3train's version and commit, dependency versions against the tested "
        "ranges, CUDA/Triton, and the kernel backend of each op family")


def add_arguments(p) -> None:
    p.add_argument("--config", help="show the kernel backends this run config picks (default: the defaults)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides for --config")


def run(args) -> int:
    from k3train.ops import kernels
    from k3train.runtime.env_report import report

    if args.config:
        from k3train.config import load_config

        kernels.apply(load_config(args.config, args.overrides))
    print(report(kernels.report_lines()))
    return 0
