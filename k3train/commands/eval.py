"""A checkpoint's loss, perplexity and bits per byte over a validation split, with a progress
bar. Any layout opens in one process; parallel.*=... overrides and torchrun also work. The
trainer's val_loss covers train.eval_batches batches, this command the whole split unless
--batches. See docs/checkpoints.md."""
from __future__ import annotations

from k3train.commands.common import RUN_CONFIG_HELP, add_checkpoint_arg

HELP = ("a checkpoint's loss, perplexity and bits per byte on a dataset's validation split "
        "(any layout; parallel.*=... overrides, torchrun)")


def add_arguments(p) -> None:
    add_checkpoint_arg(p)
    p.add_argument("--data", help="data.source to evaluate on (default: the run's)")
    p.add_argument("--batches", type=int, default=0,
                   help="validation batches of train.micro_batch_size windows (default 0: the whole split)")
    p.add_argument("--config", help=RUN_CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides, e.g. parallel.tp=2")


def run(args) -> int:
    import os

    from k3train.trainer.evaluate import evaluate_checkpoint, format_result

    result = evaluate_checkpoint(args.checkpoint, config=args.config, overrides=args.overrides,
                                 data=args.data, batches=args.batches)
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_result(result))
    return 0
