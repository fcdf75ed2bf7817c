"""Train a model: writes RUN_DIR/config.yaml (resolved), metrics.jsonl and checkpoints/; one
process, or several under torchrun. See docs/run_directory.md and docs/checkpoints.md."""
from __future__ import annotations

from k3train.commands.common import add_config_args

HELP = "train a model (CPU or GPU; torchrun for several processes)"


def add_arguments(p) -> None:
    add_config_args(p)
    p.add_argument("--run-dir", help="where config.yaml, metrics.jsonl and checkpoints go "
                                     "(default runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run directory that holds a run: its files move to "
                        "RUN_DIR/archive/<time>/ first (docs/run_directory.md)")


def run(args) -> int:
    from pathlib import Path

    from k3train.config import load_config
    from k3train.trainer.loop import train

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    train(cfg, run_dir, resume=args.resume, overwrite=args.overwrite)
    return 0
