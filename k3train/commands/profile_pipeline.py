"""A few pipeline steps under torchrun with each AttnRes transport: bytes per hop measured
against the engine's prediction and the closed forms, naive/cached ratio, peak cache memory, and
the bubble against (P-1)/(V*m); writes --json, a Chrome trace and a Gantt PNG beside it. The
timing model's predictions are the predict-pipeline command. See docs/pipeline_timing_model.md."""
from __future__ import annotations

from k3train.commands.common import add_config_args

HELP = ("pipeline p2p bytes (naive vs cached), bubble, timelines "
        "(run under torchrun with parallel.pp >= 2)")


def add_arguments(p) -> None:
    add_config_args(p)
    p.add_argument("--json", required=True, help="report path; the trace and Gantt PNG go beside it")
    p.add_argument("--steps", type=int, default=3, help="steps per transport (the last one is reported)")


def run(args) -> int:
    from k3train.config import load_config
    from k3train.profiling.pipeline import profile_pipeline
    from k3train.runtime.cuda_env import prepare_cuda_env

    cfg = load_config(args.config, args.overrides)
    prepare_cuda_env(cfg)
    profile_pipeline(cfg, args.json, steps=args.steps)
    return 0
