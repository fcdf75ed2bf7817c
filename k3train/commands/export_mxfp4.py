"""Write a checkpoint (any parallel layout) as packed MXFP4 safetensors: 4-bit codes and E8M0
scales for the quantised scope, bf16 for the rest, plus export.json;
k3train.quant.export.load_mxfp4_export reads it back. See docs/quantization.md."""
from __future__ import annotations

from k3train.commands.common import RUN_CONFIG_HELP, add_checkpoint_arg, add_overwrite_arg

HELP = "write a checkpoint as packed MXFP4 safetensors (+ export.json)"


def add_arguments(p) -> None:
    add_checkpoint_arg(p)
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--config", help=RUN_CONFIG_HELP)
    add_overwrite_arg(p, "export-mxfp4")


def run(args) -> int:
    from k3train.trainer.export import export_mxfp4

    out = export_mxfp4(args.checkpoint, args.out, args.config, overwrite=args.overwrite)
    print(f"wrote {out}/model.safetensors and export.json (mxfp4-packed, "
          f"{(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")
    return 0
