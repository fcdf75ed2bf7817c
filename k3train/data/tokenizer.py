"""Byte-level tokenizer: UTF-8 bytes 0..255 plus one end-of-document token (id 256).

Why byte-level rather than a learned BPE/unigram vocabulary:

* no training step and no download: the machines k3train runs on may reach only package
  registries, and a tokenizer that needs a vocab file from a model hub would block the
  quickstart;
* lossless for any text a user brings: every Unicode string is a byte sequence, so there is no
  unknown token and ``decode(encode(s)) == s`` always;
* deterministic and versionless: the mapping is fixed by UTF-8 itself, so a prepared dataset
  stays valid forever and two machines can never disagree about it.

The cost is sequence length: English prose takes about 4x more byte tokens than BPE tokens, so a
model sees less text per context window and per FLOP. That is acceptable for architecture
ablations, where all variants pay the same cost. The model pads its embedding to a round vocab
size (e.g. 320) elsewhere; ids >= 257 are never produced here.
"""

from __future__ import annotations

from typing import Iterable

from k3train.errors import DataError

__all__ = ["ByteTokenizer", "get_tokenizer", "TOKENIZER_NAMES"]


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; ``eod_id`` (256) ends every document.

    ``name`` is stored in a prepared dataset's ``.meta.json`` so that a dataset tokenized with one
    tokenizer is never silently read with another.
    """

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        """str -> token ids, one per UTF-8 byte (no EOD appended)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> str. EOD tokens are dropped; invalid UTF-8 becomes U+FFFD.

        Ids outside ``[0, vocab_size)`` raise ``ValueError``: they can only come from the padded
        part of a model's vocabulary, and a sampler should mask those logits rather than have
        them disappear silently here.
        """
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i != self.eod_id:
                raise ValueError(
                    f"token id {i} is outside the byte tokenizer's vocabulary "
                    f"[0, {self.vocab_size})"
                )
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


_TOKENIZERS = {"byte": ByteTokenizer}
TOKENIZER_NAMES = tuple(sorted(_TOKENIZERS))


def get_tokenizer(name: str) -> ByteTokenizer:
    """Return the tokenizer registered under ``name`` (only ``"byte"`` today)."""
    try:
        return _TOKENIZERS[name]()
    except KeyError:
        allowed = ", ".join(repr(n) for n in TOKENIZER_NAMES)
        raise DataError(f"unknown tokenizer {name!r}; allowed: {allowed}") from None
