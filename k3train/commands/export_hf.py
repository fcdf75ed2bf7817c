"""Write a checkpoint (any parallel layout) as a Hugging Face directory: config.json, sharded
model-*.safetensors with model.safetensors.index.json in Kimi Linear / DeepSeek-V3 tensor names,
the tokenizer (tokenizer_config.json, tokenizer.json) and configuration_k3train.py /
modeling_k3train.py, so that transformers loads it with trust_remote_code=True. See docs/hf_format.md."""
from __future__ import annotations

from k3train.commands.common import RUN_CONFIG_HELP, add_checkpoint_arg, add_overwrite_arg

HELP = "write a checkpoint as a Hugging Face directory (config.json, sharded safetensors)"


def add_arguments(p) -> None:
    add_checkpoint_arg(p)
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--config", help=RUN_CONFIG_HELP)
    p.add_argument("--shard-size", help="the most bytes per model-*.safetensors shard (default 5GB; e.g. 500MB, 2GiB)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="cast floating-point tensors (default: keep the checkpoint's dtype, bit for bit)")
    p.add_argument("--mxfp4", action="store_true",
                   help="store routed expert weights MXFP4-packed (.mx_codes/.mx_scales); import dequantises")
    p.add_argument("--layout", choices=["k3train", "kimi_linear"], default="k3train",
                   help="k3train (default): our tensor names plus modeling_k3train.py, loaded by transformers with "
                        "trust_remote_code=True; kimi_linear: transformers' own class, for a model that fits it "
                        "(refused otherwise, naming what does not fit)")
    add_overwrite_arg(p, "export-hf")


def run(args) -> int:
    from k3train.hf.export import parse_size
    from k3train.trainer.export import export_hf_checkpoint

    out = export_hf_checkpoint(args.checkpoint, args.out, args.config, shard_bytes=parse_size(args.shard_size or "5GB"),
                               dtype=args.dtype, mxfp4=args.mxfp4, overwrite=args.overwrite, layout=args.layout)
    print(f"wrote {out} (config.json, model.safetensors.index.json, tokenizer files"
          + (")" if args.mxfp4 else ", modeling_k3train.py: transformers loads it with trust_remote_code=True)"))
    return 0
