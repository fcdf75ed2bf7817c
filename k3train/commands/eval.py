"""A checkpoint's loss, perplexity and bits per byte over a validation split, with a progress
bar. Any layout opens in one process; parallel.*=... overrides and torchrun also work. The
trainer's val_loss covers train.eval_batches batches, this command the whole split unless
--batches. --seq-len evaluates other window lengths, --by-position prints the loss by position
in the window (does the model use its context?). See docs/checkpoints.md."""
from __future__ import annotations

from k3train.commands.common import RUN_CONFIG_HELP, add_checkpoint_arg
from k3train.errors import UsageError

HELP = ("a checkpoint's loss, perplexity and bits per byte on a dataset's validation split "
        "(any layout; parallel.*=... overrides, torchrun)")


def add_arguments(p) -> None:
    add_checkpoint_arg(p)
    p.add_argument("--data", help="data.source to evaluate on (default: the run's)")
    p.add_argument("--batches", type=int, default=0,
                   help="validation batches of train.micro_batch_size windows (default 0: the whole split)")
    p.add_argument("--seq-len", type=int, default=0,
                   help="evaluate windows of this many tokens (default 0: the run's train.seq_len)")
    p.add_argument("--by-position", action="store_true",
                   help="also print the loss by position in the window (buckets of doubling length): "
                        "whether the model uses its context")
    p.add_argument("--plot", help="with --by-position: write loss against position (log-x) to this PNG")
    p.add_argument("--config", help=RUN_CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides, e.g. parallel.tp=2")


def run(args) -> int:
    import os

    from k3train.trainer.evaluate import evaluate_checkpoint, format_result
    from k3train.trainer.position_loss import format_rows, plot_rows

    if args.plot and not args.by_position:
        raise UsageError("--plot draws the loss by position: add --by-position")
    if args.plot and os.path.lexists(args.plot):
        raise UsageError(f"--plot {args.plot} exists; name a new file (eval never replaces a file)")
    result = evaluate_checkpoint(args.checkpoint, config=args.config, overrides=args.overrides,
                                 data=args.data, batches=args.batches, seq_len=args.seq_len,
                                 by_position=args.by_position)
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_result(result))
        if args.by_position:
            print("loss by position in the window:\n" + format_rows(result["by_position"]))
        if args.plot:
            title = f"{result['checkpoint']} (step {result['step']}), windows of {result['seq_len']} tokens"
            print(f"plot: {plot_rows(result['by_position'], args.plot, title)}")
    return 0
