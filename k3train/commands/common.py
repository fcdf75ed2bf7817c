"""Arguments several commands share, written once."""
from __future__ import annotations

import argparse

CHECKPOINT_HELP = ("a run directory, its checkpoints/ directory (both use 'latest'), or a "
                   "step_XXXXXXXX directory")
RUN_CONFIG_HELP = "run config (default: config.yaml of the checkpoint's run directory)"


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` (required) and trailing ``key.sub=value`` overrides."""
    p.add_argument("--config", required=True, help="YAML run config, e.g. configs/k3_tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. train.steps=50 optim.lr=1e-3")


def add_checkpoint_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)


def add_overwrite_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace --out when it holds a previous output of {what} (never a run "
                        f"directory or another folder)")
