"""Command-line entry point: ``k3train <command> ...`` and ``python -m k3train <command> ...``.

One table, command name -> module of ``k3train/commands/``; the parser is built from it in one
loop. Each module has ``HELP``, ``add_arguments(parser)`` and ``run(args)``; its docstring is
the command's ``--help`` description."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from k3train.errors import ConfigError, K3TrainError, LayoutError

# megatron-core warns at import time that optional fused kernels are missing; we never use them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

COMMANDS = {
    "train": "train",
    "model-info": "model_info",
    "config": "config",
    "prepare-data": "prepare_data",
    "train-tokenizer": "train_tokenizer",
    "profile-pipeline": "profile_pipeline",
    "predict-pipeline": "predict_pipeline",
    "sweep": "sweep",
    "export-mxfp4": "export_mxfp4",
    "export-hf": "export_hf",
    "import": "import_hf",
    "eval": "eval",
    "generate": "generate",
    "env": "env",
}

# Former spellings, answered with one line naming the command that replaced them.
RENAMED = {
    ("export", "--format"): "'k3train export' became two commands: 'k3train export-hf' and "
                            "'k3train export-mxfp4' (same options, without --format)",
    ("profile-pipeline", "--predict"): "'k3train profile-pipeline --predict' is the command "
                                       "'k3train predict-pipeline' (same options, without --predict)",
}


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
    parser = argparse.ArgumentParser(prog="k3train", description="Train Kimi-K3-style hybrid MoE models.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"k3train.commands.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           **getattr(module, "PARSER", {}))
        module.add_arguments(p)
        p.set_defaults(fn=module.run)
    return parser


def _renamed(argv: list[str]) -> str | None:
    """The one-line answer to a former command spelling, or None."""
    if not argv:
        return None
    for (command, flag), message in RENAMED.items():
        if argv[0] == command and (command == "export" or flag in argv[1:]):
            return message
    return None


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
    argv = sys.argv[1:] if argv is None else list(argv)
    renamed = _renamed(argv)
    if renamed:
        print(f"k3train: error: {renamed}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow options such as --run-dir; argparse leaves those over.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    os.environ.setdefault("WANDB_SILENT", "true")
    _arm_stack_dump(os.environ.get("K3TRAIN_STACKS_AFTER"))
    try:
        return args.fn(args)
    except K3TrainError as exc:  # ConfigError is one too
        # Bad input or a refused operation: one clear message, no traceback. Everything else
        # (an internal ValueError included) is a bug and keeps its traceback. Under torchrun
        # every worker reads the same config and refuses it (or its layout) the same way:
        # rank 0 (torchrun's RANK) says so once, the others exit with the same status silently.
        if not (isinstance(exc, (ConfigError, LayoutError)) and os.environ.get("RANK", "0") != "0"):
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
