"""Train a byte-level BPE tokenizer (Hugging Face tokenizers) on FILES or a built-in corpus,
written as DIR/tokenizer.json for --tokenizer DIR / data.tokenizer=DIR. See docs/data.md."""
from __future__ import annotations

import argparse

from k3train.data.prepare import ALLOWED_EXTENSIONS
from k3train.data.train_tokenizer import CORPORA

HELP = "train a byte-level BPE tokenizer (writes DIR/tokenizer.json)"
PARSER = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}


def add_arguments(p) -> None:
    p.add_argument("files", nargs="*", help=f"training text ({', '.join(ALLOWED_EXTENSIONS)}; a .txt file is "
                                            f"one document)")
    p.add_argument("--corpus", choices=CORPORA, help="train on a built-in corpus instead of FILES "
                                                     "(stdlib: its train split)")
    p.add_argument("--vocab-size", type=int, required=True, help="tokens including 256 bytes and <|endoftext|>")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--min-frequency", type=int, default=2, help="merge only pairs seen this often")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a tokenizer.json already in --out (refused otherwise)")
    p.add_argument("--text-key", default="text", help="field (.jsonl) or column (.parquet) holding the text")


def run(args) -> int:
    import sys
    from pathlib import Path

    from k3train.data.prepare import check_inputs, read_documents
    from k3train.data.tokenizer import load_tokenizer
    from k3train.data.train_tokenizer import corpus_documents, train_bpe
    from k3train.errors import UsageError

    if bool(args.files) == bool(args.corpus):
        raise UsageError("train-tokenizer needs input FILES or --corpus NAME (one of the two)")
    if args.corpus:
        docs = corpus_documents(args.corpus)
    else:
        paths = check_inputs(args.files)
        docs = (d for p in paths for d in read_documents(p, args.text_key))
    path = train_bpe(docs, args.vocab_size, args.out, min_frequency=args.min_frequency,
                     progress=sys.stderr.isatty(), overwrite=args.overwrite)
    tok = load_tokenizer(path)
    print(f"wrote {path}: byte-level BPE, vocab {tok.vocab_size}, eod {tok.eod_id} (<|endoftext|>)")
    print(f"use it with: k3train prepare-data FILES --tokenizer {Path(args.out)} --output-prefix PREFIX")
    return 0
