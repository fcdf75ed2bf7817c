"""The data commands of the CLI: ``k3train prepare-data`` and ``k3train train-tokenizer``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3train.data.prepare import ALLOWED_EXTENSIONS
from k3train.data.tokenizer import SPEC_HELP
from k3train.data.train_tokenizer import CORPORA

__all__ = ["add_prepare_data", "add_train_tokenizer"]


def _cmd_prepare_data(args) -> int:
    from k3train.data import load_tokenizer, prepare_data

    split = "lines" if args.split_lines else "blank-lines" if args.split_blank_lines else "none"
    tokenizer = load_tokenizer(args.tokenizer)
    stats = prepare_data(args.inputs, args.output_prefix, tokenizer, text_key=args.text_key,
                         progress=None if args.progress == "auto" else args.progress == "on",
                         txt_split=split, workers=args.workers)
    print(f"wrote {args.output_prefix}.bin/.idx/.meta.json: {stats['num_documents']:,} documents, "
          f"{stats['num_tokens']:,} tokens ({tokenizer.name}, vocab {tokenizer.vocab_size})")
    vocab = "" if tokenizer.vocab_size <= 320 else f" model.vocab_size={-(-tokenizer.vocab_size // 64) * 64}"
    print(f"train on it with: k3train train --config configs/k3_tiny.yaml data.source={args.output_prefix}{vocab}")
    return 0


def add_prepare_data(sub) -> None:
    exts = "/".join(ALLOWED_EXTENSIONS)
    p = sub.add_parser("prepare-data", help=f"tokenize {exts} files into a Megatron indexed dataset",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
                   help="tokenizer processes; 0: one per core (up to 8) when the inputs total 16 MiB or "
                        "more, else 1")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar (documents, tokens, bytes/s) on stderr; auto: for 16 MiB or more")
    p.set_defaults(fn=_cmd_prepare_data)


def _cmd_train_tokenizer(args) -> int:
    from k3train.data.prepare import read_documents, _check_inputs
    from k3train.data.tokenizer import load_tokenizer
    from k3train.data.train_tokenizer import corpus_documents, train_bpe
    from k3train.errors import UsageError

    if bool(args.files) == bool(args.corpus):
        raise UsageError("train-tokenizer needs input FILES or --corpus NAME (one of the two)")
    if args.corpus:
        docs = corpus_documents(args.corpus)
    else:
        paths = _check_inputs(args.files)
        docs = (d for p in paths for d in read_documents(p, args.text_key))
    path = train_bpe(docs, args.vocab_size, args.out, min_frequency=args.min_frequency,
                     progress=sys.stderr.isatty())
    tok = load_tokenizer(path)
    print(f"wrote {path}: byte-level BPE, vocab {tok.vocab_size}, eod {tok.eod_id} (<|endoftext|>)")
    print(f"use it with: k3train prepare-data FILES --tokenizer {Path(args.out)} --output-prefix PREFIX")
    return 0


def add_train_tokenizer(sub) -> None:
    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer (writes DIR/tokenizer.json)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("files", nargs="*", help=f"training text ({', '.join(ALLOWED_EXTENSIONS)}; a .txt file is "
                                            f"one document)")
    p.add_argument("--corpus", choices=CORPORA, help="train on a built-in corpus instead of FILES "
                                                     "(stdlib: its train split)")
    p.add_argument("--vocab-size", type=int, required=True, help="tokens including 256 bytes and <|endoftext|>")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--min-frequency", type=int, default=2, help="merge only pairs seen this often")
    p.add_argument("--text-key", default="text", help="field (.jsonl) or column (.parquet) holding the text")
    p.set_defaults(fn=_cmd_train_tokenizer)
