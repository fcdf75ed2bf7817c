"""Train a byte-level BPE (``k3train train-tokenizer``) with the Hugging Face ``tokenizers`` library.

Byte-level: the 256 byte values are the initial alphabet, so any Unicode string encodes without
an unknown token and ``decode(encode(s)) == s``; no normalizer runs, so nothing is folded or
stripped. ``<|endoftext|>`` is the one special token and the EOD id. The result is a
``tokenizer.json`` that ``load_tokenizer`` reads (kind ``hf``).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Iterator

from k3train.data.corpus import embedded_documents
from k3train.data.stdlib_corpus import stdlib_documents
from k3train.data.tokenizer import _require
from k3train.errors import DataError
from k3train.runtime.files import writable_ancestor_problem

__all__ = ["train_bpe", "corpus_documents", "CORPORA"]

CORPORA = ("embedded", "stdlib")
_MIN_VOCAB = 256 + 1  # every byte plus the EOD token


def corpus_documents(name: str, split: str = "train") -> Iterator[str]:
    """A built-in corpus's documents: ``embedded`` (all of it) or ``stdlib`` (its ``split``)."""
    if name == "embedded":

        yield from embedded_documents()
    elif name == "stdlib":

        for _, text in stdlib_documents(split):
            yield text
    else:
        raise DataError(f"unknown corpus {name!r}; allowed: {', '.join(CORPORA)}")


def check_tokenizer_out(out_dir: Path, overwrite: bool) -> None:
    """Refuse, changing nothing, an ``out_dir`` that is a file or already holds a
    ``tokenizer.json`` (without ``overwrite``): a dataset made with it could no longer be decoded."""
    existing = out_dir / "tokenizer.json"
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {out_dir} is a file, not a directory; choose another --out")
    if existing.exists() and not overwrite:
        raise DataError(f"{existing} exists (a trained tokenizer); pass --overwrite to replace it, "
                        f"or choose another --out")
    problem = writable_ancestor_problem(out_dir)
    if problem is not None:
        raise DataError(f"--out {out_dir}: {problem}")


def train_bpe(documents: Iterable[str], vocab_size: int, out_dir: str | Path, *,
              min_frequency: int = 2, progress: bool = False, overwrite: bool = False) -> Path:
    """Train on ``documents`` and write ``out_dir/tokenizer.json``; returns its path.

    An existing ``out_dir/tokenizer.json`` is replaced only with ``overwrite`` (refused before
    training otherwise).

    ``vocab_size`` counts the 256 bytes and ``<|endoftext|>``; the trainer stops early when no
    pair occurs ``min_frequency`` times, so a small corpus may give fewer tokens.
    """
    if vocab_size < _MIN_VOCAB:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{_MIN_VOCAB} (256 bytes + <|endoftext|>)")

    out = Path(out_dir)
    check_tokenizer_out(out, overwrite)
    tk = _require("tokenizers", "tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                     special_tokens=["<|endoftext|>"], show_progress=progress,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    seen = [0]

    def counted() -> Iterator[str]:
        for doc in documents:
            seen[0] += 1
            yield doc

    tok.train_from_iterator(counted(), trainer=trainer)
    if seen[0] == 0:
        raise DataError("train-tokenizer found no documents in its inputs")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tmp = out / "tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(path)
    if progress:
        print(f"[train-tokenizer] {seen[0]:,} documents -> {tok.get_vocab_size():,} tokens", file=sys.stderr)
    return path
