"""Tokenizers: byte-level (built in), Hugging Face ``tokenizers``, tiktoken BPE, sentencepiece.

``load_tokenizer(spec)`` is the one entry point. ``spec`` is

* ``"byte"``: UTF-8 bytes 0..255 plus one end-of-document token (id 256), no files;
* a Hugging Face ``tokenizer.json``, or a directory holding one (``k3train train-tokenizer``
  writes these);
* a tiktoken BPE file (lines ``<base64 token> <rank>``, e.g. ``*.tiktoken`` or Kimi's
  ``tiktoken.model``); its special tokens come from a ``tokenizer_config.json`` beside it
  (``added_tokens_decoder``, the Hugging Face layout) or, without one, a single
  ``<|endoftext|>`` after the last rank;
* a sentencepiece ``.model`` file (told apart from a tiktoken ``.model`` by its content).

Every tokenizer returned has

* ``encode(text: str) -> list[int]`` (no EOD appended; special-token text such as
  ``"<|endoftext|>"`` inside a document is encoded as ordinary text, never as a control token);
* ``decode(ids: Iterable[int]) -> str`` (EOD tokens are dropped);
* ``vocab_size`` (ids are in ``[0, vocab_size)``), ``eod_id``;
* ``kind`` (``"byte"``, ``"hf"``, ``"tiktoken"``, ``"sentencepiece"``), ``files_hash`` (sha256 of
  the files that define it, hex; a fixed string for ``byte``), ``spec`` (what to pass to
  ``load_tokenizer`` to get it back: ``"byte"`` or an absolute path) and ``name`` (for messages).

A prepared dataset's ``.meta.json`` records kind, files hash, vocab size, EOD id and spec, and a
dataset is never read with a tokenizer whose kind, hash, vocab size or EOD id differ.

The libraries are optional (extras ``tokenizers``, ``tiktoken``, ``sentencepiece``) and imported
only when a tokenizer of that kind is loaded; a missing one is a one-line install hint.

Why byte-level is the default: no training step and no download (the machines may reach only
package registries), lossless for any text, and fixed by UTF-8 itself so a dataset stays valid
forever. The cost is sequence length (about 4x more tokens than BPE on English prose), which all
variants of an architecture ablation pay alike.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import re
from pathlib import Path
from typing import Iterable

import numpy as np

from k3train.errors import DataError

__all__ = ["ByteTokenizer", "load_tokenizer", "get_tokenizer", "TOKENIZER_KINDS", "SPEC_HELP", "EOD_NAMES"]

TOKENIZER_KINDS = ("byte", "hf", "tiktoken", "sentencepiece")
SPEC_HELP = ("'byte', a Hugging Face tokenizer.json (or a directory holding one), a tiktoken BPE file "
             "(.tiktoken / tiktoken.model), or a sentencepiece .model file")
# Names an end-of-document token goes by, in the order they are looked for.
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
# Split pattern for tiktoken files: words with one optional leading non-letter, runs of up to
# three digits, punctuation runs, and whitespace (a trailing space stays with the next word).
# Any pattern is lossless here, since every byte is a token; this one keeps merges within words.
_TIKTOKEN_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                     r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+$")


def _require(module: str, extra: str):
    """Import an optional library, or fail in one line saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"this tokenizer needs the '{module}' package, which is not installed: "
                        f"pip install 'k3train[{extra}]'") from None


def _sha256(*paths: Path) -> str:
    """Hash of the files' contents (not their names: a renamed or moved copy is the same
    tokenizer), each preceded by its length so that two files cannot run into each other."""
    h = hashlib.sha256()
    for p in paths:
        data = p.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; ``eod_id`` (256) ends every document."""

    name = "byte"
    kind = "byte"
    spec = "byte"
    files_hash = "byte-utf8-v1"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        """str -> token ids, one per UTF-8 byte (no EOD appended)."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """str -> uint8 ids [n_bytes], without a Python int per byte (prepare-data's fast path)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

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


class _FileTokenizer:
    """Shared attributes of the file-backed kinds; subclasses set ``kind`` and the codec."""

    kind = ""

    def __init__(self, path: Path, files: list[Path], vocab_size: int, eod_id: int) -> None:
        self.spec = str(path.resolve())
        self.name = f"{self.kind}:{path.name}"
        self.files_hash = _sha256(*files)
        self.vocab_size, self.eod_id = int(vocab_size), int(eod_id)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size}, "
                f"eod_id={self.eod_id}, hash={self.files_hash[:12]})")


class HFTokenizer(_FileTokenizer):
    """A Hugging Face ``tokenizers`` ``tokenizer.json``."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        tokenizers = _require("tokenizers", "tokenizers")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise DataError(f"{path} is not a valid Hugging Face tokenizer.json ({e})") from None
        # Special-token text inside a document is data, not a control token: "<|endoftext|>"
        # written in a source file must not end the document early.
        tok.encode_special_tokens = True
        vocab = tok.get_vocab(with_added_tokens=True)
        eod = next((vocab[n] for n in EOD_NAMES if n in vocab), None)
        if eod is None:
            raise DataError(f"{path} has no end-of-document token; add one of {', '.join(EOD_NAMES)} "
                            f"as a special token")
        self._tok = tok
        super().__init__(path, [path], max(vocab.values()) + 1, eod)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Several documents at once (the library encodes them on its own threads)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eod_id], skip_special_tokens=False)


def _tiktoken_special(path: Path, n_ranks: int) -> tuple[dict[str, int], list[Path]]:
    """Special tokens from ``tokenizer_config.json`` beside ``path``, else ``<|endoftext|>``."""
    config = path.parent / "tokenizer_config.json"
    if not config.is_file():
        return {"<|endoftext|>": n_ranks}, []
    try:
        added = json.loads(config.read_text())["added_tokens_decoder"]
        special = {str(v["content"]): int(k) for k, v in added.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{config}: expected 'added_tokens_decoder' {{id: {{content: ...}}}} ({e!r})") from None
    return special, [config]


class TiktokenTokenizer(_FileTokenizer):
    """A tiktoken BPE file: ``<base64 token bytes> <rank>`` per line, every single byte ranked."""

    kind = "tiktoken"

    def __init__(self, path: Path) -> None:
        tiktoken = _require("tiktoken", "tiktoken")
        ranks: dict[bytes, int] = {}
        line_of_rank: dict[int, int] = {}  # a rank is a token id: two tokens cannot share one
        for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                token, rank_text = line.split()
                token_bytes, rank = base64.b64decode(token, validate=True), int(rank_text)
            except ValueError:
                raise DataError(f"{path}:{lineno}: expected '<base64 token> <rank>'") from None
            if rank < 0:
                raise DataError(f"{path}:{lineno}: rank {rank} is negative; ranks are token ids >= 0")
            if rank in line_of_rank:
                raise DataError(f"{path}:{lineno}: rank {rank} repeats line {line_of_rank[rank]}'s; every "
                                f"token needs its own rank")
            if token_bytes in ranks:
                raise DataError(f"{path}:{lineno}: token {token.decode('ascii')} repeats (rank "
                                f"{ranks[token_bytes]} before); every token appears once")
            ranks[token_bytes], line_of_rank[rank] = rank, lineno
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise DataError(f"{path} lacks {len(missing)} of the 256 single-byte tokens (first: byte "
                            f"{missing[0]}); a byte-level BPE file must rank every byte")
        special, extra_files = _tiktoken_special(path, max(ranks.values()) + 1)
        eod = next((special[n] for n in EOD_NAMES if n in special), None)
        if eod is None:
            raise DataError(f"{path}: no end-of-document special token among {sorted(special)}; "
                            f"expected one of {', '.join(EOD_NAMES)}")
        self._enc = tiktoken.Encoding(path.stem, pat_str=_TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=special)
        super().__init__(path, [path, *extra_files], self._enc.n_vocab, eod)

    def encode(self, text: str) -> list[int]:
        # disallowed_special=(): special-token text in a document is encoded as plain text.
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) != self.eod_id])


class SentencePieceTokenizer(_FileTokenizer):
    """A sentencepiece model; its own ``eos`` piece is the EOD token."""

    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        spm = _require("sentencepiece", "sentencepiece")
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise DataError(f"{path} is not a valid sentencepiece model ({e})") from None
        if sp.eos_id() < 0:
            raise DataError(f"{path} has no eos piece (trained with eos_id=-1); sentencepiece's eos "
                            f"is the end-of-document token: retrain with eos_id >= 0")
        self._sp = sp
        super().__init__(path, [path], sp.GetPieceSize(), sp.eos_id())

    def encode(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.EncodeAsIds(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids if int(i) != self.eod_id])


def _is_tiktoken_file(path: Path) -> bool:
    with open(path, "rb") as f:
        first = f.readline(4096).strip()
    return bool(_TIKTOKEN_LINE.match(first))


def _is_json_tokenizer(path: Path) -> bool:
    """A Hugging Face ``tokenizer.json`` under any name: a JSON object with a ``model`` entry."""
    with open(path, "rb") as f:
        head = f.read(1).lstrip()
    if head != b"{":
        return False
    try:
        return "model" in json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False


def _is_sentencepiece_file(path: Path) -> bool:
    """A sentencepiece model under any name (``tokenizer.model.v3`` as mistral-common ships them):
    a serialised ModelProto starts with its first piece, protobuf field 1 (byte 0x0a)."""
    with open(path, "rb") as f:
        return f.read(1) == b"\x0a"


def load_tokenizer(spec: str | Path):
    """The tokenizer ``spec`` names (see the module docstring for what a spec may be)."""
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(f"tokenizer directory {path} holds no tokenizer.json; allowed: {SPEC_HELP}")
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"unknown tokenizer {str(spec)!r} (no such file); allowed: {SPEC_HELP}")
    # The name decides where it is conventional; otherwise the content does, so that versioned
    # names (tokenizer.model.v3, tok.json.bak) load as what they hold.
    if path.suffix == ".json" or _is_json_tokenizer(path):
        return HFTokenizer(path)
    if path.suffix == ".tiktoken" or _is_tiktoken_file(path):
        return TiktokenTokenizer(path)
    if path.suffix == ".model" or _is_sentencepiece_file(path):
        return SentencePieceTokenizer(path)
    raise DataError(f"cannot tell which kind of tokenizer {path} is from its name or content; "
                    f"allowed: {SPEC_HELP}")


def get_tokenizer(name: str):
    """Alias of ``load_tokenizer`` (the name earlier versions used)."""
    return load_tokenizer(name)
