"""Tokenize .txt, .jsonl and .parquet files into a Megatron indexed dataset (PREFIX.bin, .idx,
.meta.json); train on it with data.source=PREFIX. See docs/data.md."""
from __future__ import annotations

import argparse

from k3train.data.prepare import ALLOWED_EXTENSIONS
from k3train.data.tokenizer import SPEC_HELP

HELP = f"tokenize {'/'.join(ALLOWED_EXTENSIONS)} files into a Megatron indexed dataset"
PARSER = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}


def add_arguments(p) -> None:
    p.add_argument("inputs", nargs="+", help=f"input files ({', '.join(ALLOWED_EXTENSIONS)}); a .txt file is "
                                             f"one document unless --split-lines/--split-blank-lines")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    p.add_argument("--tokenizer", default="byte", help=f"one of: {SPEC_HELP}")
    p.add_argument("--text-key", default="text", help="field (.jsonl) or column (.parquet) holding the text")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--split-lines", action="store_true", help="each line of a .txt file is a document")
    split.add_argument("--split-blank-lines", action="store_true",
                       help="each blank-line-separated paragraph of a .txt file is a document")
    p.add_argument("--workers", type=int, default=0,
                   help="tokenizer processes, capped at the cores available; 0: one per core (up to 8) "
                        "when the inputs total 16 MiB or more, else 1")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already at --output-prefix (refused otherwise)")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar (documents, tokens, bytes/s) on stderr; auto: for 16 MiB or more")


def run(args) -> int:
    from k3train.data import load_tokenizer, prepare_data

    split = "lines" if args.split_lines else "blank-lines" if args.split_blank_lines else "none"
    tokenizer = load_tokenizer(args.tokenizer)
    stats = prepare_data(args.inputs, args.output_prefix, tokenizer, text_key=args.text_key,
                         progress=None if args.progress == "auto" else args.progress == "on",
                         txt_split=split, workers=args.workers, overwrite=args.overwrite)
    empty = f", {stats['empty_documents']:,} empty documents skipped" if stats["empty_documents"] else ""
    print(f"wrote {args.output_prefix}.bin/.idx/.meta.json: {stats['num_documents']:,} documents, "
          f"{stats['num_tokens']:,} tokens ({tokenizer.name}, vocab {tokenizer.vocab_size}){empty}")
    vocab = "" if tokenizer.vocab_size <= 320 else f" model.vocab_size={-(-tokenizer.vocab_size // 64) * 64}"
    print(f"train on it with: k3train train --config configs/k3_tiny.yaml data.source={args.output_prefix}{vocab}")
    return 0
