"""Make tokenizer files of the other kinds locally, for tests and benchmarks (no download; not part of the installed package).

* ``write_tiktoken(tokenizer_json, out)``: the BPE of a byte-level ``tokenizer.json`` (as
  ``k3train train-tokenizer`` writes) as a tiktoken file, ``<base64 token bytes> <rank>`` per
  line; its ``<|endoftext|>`` becomes the id after the last rank, where ``load_tokenizer``
  puts it for a file without ``tokenizer_config.json``.
* ``train_sentencepiece(documents, vocab_size, out)``: a sentencepiece BPE with byte fallback
  and no normalisation, so that ``decode(encode(s)) == s``.
"""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Iterable

from k3train.errors import DataError

__all__ = ["write_tiktoken", "train_sentencepiece", "byte_level_alphabet"]


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE's character for each byte -> that byte.

    Bytes that are printable Latin-1 characters ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for
    themselves; the other 68 bytes, in increasing order, take the characters U+0100, U+0101, ...
    (so that no token holds whitespace or control characters)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def write_tiktoken(tokenizer_json: str | Path, out: str | Path) -> Path:
    """Write the BPE vocabulary of ``tokenizer_json`` as a tiktoken file at ``out``.

    Ranks follow the BPE's ids (the order its merges were learned in, after the 256 bytes),
    renumbered from 0 without the special tokens."""
    model = json.loads(Path(tokenizer_json).read_text())["model"]
    if model.get("type") != "BPE":
        raise DataError(f"{tokenizer_json} is a {model.get('type')} model; write_tiktoken needs a byte-level BPE")
    alphabet = byte_level_alphabet()
    tokens = []
    for token, idx in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        try:
            tokens.append(bytes(alphabet[c] for c in token))
        except KeyError:
            continue  # a special token (not made of byte characters)
    out = Path(out)
    out.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    return out


def train_sentencepiece(documents: Iterable[str], vocab_size: int, out: str | Path) -> Path:
    """Train a sentencepiece BPE on ``documents`` and write the model to ``out``."""
    from k3train.data.tokenizer import _require

    spm = _require("sentencepiece", "sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(documents), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False,
        remove_extra_whitespaces=False, max_sentence_length=1 << 20, minloglevel=2)
    out = Path(out)
    out.write_bytes(buf.getvalue())
    return out
