"""The CLI's ``export --format hf`` and ``import`` subcommands (registered in k3train/cli.py)."""
from __future__ import annotations

import argparse


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shard-size",
                   help="hf: the most bytes per model-*.safetensors shard (default 5GB; e.g. 500MB, 2GiB)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="hf: cast floating-point tensors (default: keep the checkpoint's dtype, bit for bit)")
    p.add_argument("--mxfp4", action="store_true",
                   help="hf: store routed expert weights MXFP4-packed (.mx_codes/.mx_scales); import dequantises")


def refuse_hf_options(args) -> None:
    """The hf-only options with another --format: refused, not silently ignored."""
    from k3train.errors import UsageError

    given = [flag for flag, value in (("--shard-size", args.shard_size), ("--dtype", args.dtype),
                                      ("--mxfp4", args.mxfp4)) if value]
    if given:
        raise UsageError(f"{', '.join(given)} apply to --format hf only, not --format {args.format}")


def run_export_hf(args) -> int:
    from k3train.hf.export import parse_size
    from k3train.trainer.export import export_hf_checkpoint

    out = export_hf_checkpoint(args.checkpoint, args.out, args.config, shard_bytes=parse_size(args.shard_size or "5GB"),
                               dtype=args.dtype, mxfp4=args.mxfp4)
    print(f"wrote {out} (config.json, model.safetensors.index.json, tokenizer_config.json)")
    return 0


def add_import_parser(sub) -> None:
    p = sub.add_parser("import", help="read a Hugging Face directory (from 'export --format hf') into a run "
                                      "directory: config.yaml + a weights-only checkpoint for train.init_from")
    p.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json and model.safetensors.index.json")
    p.add_argument("--out", required=True, help="run directory to create (config.yaml, checkpoints/step_00000000)")
    p.add_argument("--config", help="run config whose train/optim/data settings the new config.yaml keeps "
                                    "(default: the defaults); model and moe come from HF_DIR")
    p.set_defaults(fn=run_import)


def run_import(args) -> int:
    from k3train.trainer.hf_import import import_hf

    step_dir = import_hf(args.hf_dir, args.out, args.config)
    print(f"wrote {step_dir} and {step_dir.parent.parent / 'config.yaml'}")
    return 0
