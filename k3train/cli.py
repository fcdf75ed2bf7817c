"""Command-line entry point: ``k3train <command> ...`` and ``python -m k3train <command> ...``."""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

# megatron-core warns at import time that optional fused kernels are missing; we never use them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config, e.g. configs/k3_tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. train.steps=50 optim.lr=1e-3")


def _cmd_train(args) -> int:
    from k3train.config import load_config
    from k3train.runtime.cuda_env import prepare_cuda_env

    cfg = load_config(args.config, args.overrides)
    prepare_cuda_env(cfg)
    from k3train.trainer.loop import train

    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    train(cfg, run_dir, resume=args.resume, overwrite=args.overwrite)
    return 0


def _cmd_model_info(args) -> int:
    from k3train.config import load_config
    from k3train.runtime.distributed import init_distributed, shutdown_distributed
    from k3train.model.info import format_info, model_info

    cfg = load_config(args.config, args.overrides)
    from k3train.profiling.memory_plan import memory_report

    init_distributed()
    try:
        counts, assumptions = model_info(cfg)
        memory = memory_report(cfg, args.dp)   # builds on the meta device too: needs the groups
    finally:
        shutdown_distributed()
    print(f"model: {args.config}  ({cfg.model.num_layers} layers, pattern {cfg.model.layer_pattern}, "
          f"hidden {cfg.model.hidden_size}, {cfg.moe.num_experts} experts top-{cfg.moe.topk})")
    print(format_info(counts, assumptions))
    print(memory)
    return 0


def _cmd_sweep(args) -> int:
    from k3train.sweep.runner import run_sweep

    run_sweep(args.ablation, args.out, args.overrides, dry_run=args.dry_run, seeds=args.seeds,
              only=args.only, jobs=args.jobs, collect=args.collect)
    return 0


def _cmd_export(args) -> int:
    from k3train.hf.commands import refuse_hf_options, run_export_hf
    from k3train.trainer.export import export_mxfp4

    if args.format == "hf":
        return run_export_hf(args)
    refuse_hf_options(args)
    out = export_mxfp4(args.checkpoint, args.out, args.config)
    print(f"wrote {out}/model.safetensors and export.json ({args.format}, "
          f"{(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")
    return 0


def _cmd_eval(args) -> int:
    from k3train.trainer.evaluate import evaluate_checkpoint, format_result

    result = evaluate_checkpoint(args.checkpoint, config=args.config, overrides=args.overrides,
                                 data=args.data, batches=args.batches)
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_result(result))
    return 0


def _cmd_profile_pipeline(args) -> int:
    from k3train.config import load_config
    from k3train.runtime.cuda_env import prepare_cuda_env

    cfg = load_config(args.config, args.overrides)
    prepare_cuda_env(cfg)
    if args.predict:
        from k3train.profiling.predict import H200_LINK, run_predict
        from pipeline.timing_model import LinkCost

        link = LinkCost(latency_s=(args.link_latency_us * 1e-6 if args.link_latency_us is not None
                                   else H200_LINK.latency_s),
                        bandwidth_Bps=args.link_gbps * 1e9 if args.link_gbps else H200_LINK.bandwidth_Bps)
        run_predict(cfg, args.json, costs_path=args.costs, k3_config=args.k3_config or None, link=link,
                    steps=args.steps, layers_per_chunk=args.layers_per_chunk)
        return 0
    from k3train.profiling.pipeline import profile_pipeline

    profile_pipeline(cfg, args.json, steps=args.steps)
    return 0


def _cmd_env(args) -> int:
    from k3train.ops import kernels
    from k3train.runtime.env_report import report

    if args.config:
        from k3train.config import load_config

        kernels.apply(load_config(args.config, args.overrides))
    print(report())
    return 0


def _version_string() -> str:
    from k3train.runtime.env_report import commit, version

    return f"k3train {version()} (commit {commit()})"


class _VersionAction(argparse.Action):
    """``--version``, computed only when asked (it runs git)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print k3train's version and commit, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version_string())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from k3train.hf import commands as hf_commands

    parser = argparse.ArgumentParser(prog="k3train", description="Train Kimi-K3-style hybrid MoE models.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (CPU or GPU; torchrun for several processes)")
    _add_config_args(p)
    p.add_argument("--run-dir", help="where config.yaml, metrics.jsonl and checkpoints go "
                                     "(default runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run directory that holds a run: its files move to "
                        "RUN_DIR/archive/<time>/ first (docs/run-directory.md)")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("model-info", help="print parameters per component and the per-rank memory of the layout")
    _add_config_args(p)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas per pipeline stage for the "
                   "memory plan (a multiple of parallel.ep; docs/memory.md)")
    p.set_defaults(fn=_cmd_model_info)

    from k3train.data.commands import add_prepare_data, add_train_tokenizer

    add_prepare_data(sub)
    add_train_tokenizer(sub)

    p = sub.add_parser("profile-pipeline", help="pipeline p2p bytes (naive vs cached), bubble, timelines "
                                                 "(run under torchrun with parallel.pp >= 2)")
    _add_config_args(p)
    p.add_argument("--json", required=True, help="report path; the trace and Gantt PNG go beside it")
    p.add_argument("--steps", type=int, default=3, help="steps per transport (the last one is reported)")
    p.add_argument("--predict", action="store_true",
                   help="one process: measure per-layer times, print the timing model's table for "
                        "P in 2,4,8,16, V in 1,2,4, m in 8,16,32 and K3's shapes (docs/pipeline_timing_model.md)")
    p.add_argument("--costs", help="with --predict: per-layer times from this json (a report's layer_costs)")
    p.add_argument("--k3-config", default="configs/k3_full.yaml",
                   help="with --predict: the K3 shapes scaled by FLOPs ('' to skip)")
    p.add_argument("--link-latency-us", type=float, help="with --predict: p2p latency (default 32, 2x H200)")
    p.add_argument("--link-gbps", type=float, help="with --predict: p2p bandwidth GB/s (default 315, 2x H200)")
    p.add_argument("--layers-per-chunk", type=int, default=1,
                   help="with --predict: time chunks of this many layers and split each by FLOPs (default 1)")
    p.set_defaults(fn=_cmd_profile_pipeline)

    p = sub.add_parser("sweep", help="run an ablation file's variants one after another; tabulate and plot")
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
    p.set_defaults(fn=_cmd_sweep)

    p = sub.add_parser("export", help="write a checkpoint as packed MXFP4 safetensors (+ export.json), or as "
                                      "a Hugging Face directory (--format hf)")
    p.add_argument("--checkpoint", required=True,
                   help="a step_XXXXXXXX directory, or a run's checkpoints/ directory (uses 'latest')")
    p.add_argument("--format", required=True, choices=["mxfp4-packed", "hf"], help="output format")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--config", help="run config (default: config.yaml of the checkpoint's run directory)")
    hf_commands.add_export_args(p)
    p.set_defaults(fn=_cmd_export)
    hf_commands.add_import_parser(sub)

    p = sub.add_parser("eval", help="a checkpoint's loss, perplexity and bits per byte on a dataset's "
                                    "validation split (any layout; parallel.*=... overrides, torchrun)")
    p.add_argument("--checkpoint", required=True,
                   help="a step_XXXXXXXX directory, or a run's checkpoints/ directory (uses 'latest')")
    p.add_argument("--data", help="data.source to evaluate on (default: the run's)")
    p.add_argument("--batches", type=int, default=0,
                   help="validation batches of train.micro_batch_size windows (default 0: the whole split)")
    p.add_argument("--config", help="run config (default: config.yaml of the checkpoint's run directory)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides, e.g. parallel.tp=2")
    p.set_defaults(fn=_cmd_eval)

    from k3train.infer.cli_args import add_parser as add_generate

    add_generate(sub)

    p = sub.add_parser("env", help="k3train's version and commit, dependency versions against the tested "
                                   "ranges, CUDA/Triton, and the kernel backend of each op family")
    p.add_argument("--config", help="show the kernel backends this run config picks (default: the defaults)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides for --config")
    p.set_defaults(fn=_cmd_env)
    return parser


def _arm_stack_dump(seconds: str | None) -> None:
    """``K3TRAIN_STACKS_AFTER=S``: print every thread's Python stack to stderr S seconds in, and
    every S seconds after (finding where a hung multi-process run waits)."""
    if not seconds:
        return
    try:
        after = float(seconds)
        if after <= 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"K3TRAIN_STACKS_AFTER={seconds!r}: expected a positive number of seconds") from None
    import faulthandler

    faulthandler.dump_traceback_later(after, repeat=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow options such as --run-dir; argparse leaves those over.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    os.environ.setdefault("WANDB_SILENT", "true")
    _arm_stack_dump(os.environ.get("K3TRAIN_STACKS_AFTER"))
    from k3train.errors import K3TrainError

    try:
        return args.fn(args)
    except K3TrainError as exc:  # ConfigError is one too
        # Bad input or a refused operation: one clear message, no traceback. Everything else
        # (an internal ValueError included) is a bug and keeps its traceback.
        print(f"k3train: error: {exc}", file=sys.stderr)
        return 2


def entry() -> None:
    """``k3train`` and ``python -m k3train``: ``main``, then an exit that leftover compile
    workers, executor threads or process groups cannot delay (k3train/runtime/process_exit.py)."""
    code = main()
    from k3train.runtime.process_exit import finish_process

    finish_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
