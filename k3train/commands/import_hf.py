"""Read a Hugging Face directory written by export-hf (MXFP4-packed experts dequantised) into a
new run directory: config.yaml and a weights-only checkpoint for train.init_from.
See docs/hf_format.md."""
from __future__ import annotations

from k3train.commands.common import add_overwrite_arg

HELP = ("read a Hugging Face directory (from 'export-hf') into a run directory: config.yaml + a "
        "weights-only checkpoint for train.init_from")


def add_arguments(p) -> None:
    p.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json and model.safetensors.index.json")
    p.add_argument("--out", required=True, help="run directory to create (config.yaml, checkpoints/step_00000000)")
    p.add_argument("--config", help="run config whose train/optim/data settings the new config.yaml keeps "
                                    "(default: the defaults); model and moe come from HF_DIR")
    add_overwrite_arg(p, "import")


def run(args) -> int:
    from k3train.trainer.hf_import import import_hf

    step_dir = import_hf(args.hf_dir, args.out, args.config, overwrite=args.overwrite)
    print(f"wrote {step_dir} and {step_dir.parent.parent / 'config.yaml'}")
    return 0
