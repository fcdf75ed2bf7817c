"""The run's tokenizer in an HF export, as ``transformers.AutoTokenizer`` reads it.

* the byte tokenizer becomes a ``tokenizers`` byte-level ``tokenizer.json``: each UTF-8 byte
  is one token whose id is the byte's value (GPT-2's byte-to-character table names the 256
  tokens) and ``<|endoftext|>`` is the special token 256, so ``PreTrainedTokenizerFast`` encodes
  and decodes exactly as ``ByteTokenizer`` (written as JSON here: no tokenizers import);
* a ``tokenizers`` tokenizer (kind ``hf``) is copied, also as ``tokenizer.json``;
* a tiktoken file is copied and also written as a ``tokenizers`` BPE ``tokenizer.json`` (the same
  ranks as vocabulary, a merge for every way a token splits into two tokens, ranked by the
  token's rank, which is the pair tiktoken merges first; the same split pattern; its special
  tokens as added tokens);
* a sentencepiece model is copied for k3train (``k3train import``, ``data.tokenizer``);
  ``AutoTokenizer`` does not read it as it stands (docs/hf_format.md).

``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` where a ``tokenizer.json`` exists, and
always k3train's record (kind, files hash, vocabulary size, EOD id).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from k3train.data.tokenizer import ByteTokenizer

EOD_TOKEN = "<|endoftext|>"


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible table: byte -> one printable character (what a ``ByteLevel``
    pre-tokenizer turns each byte into)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # control bytes, space and the gaps map to the characters after U+00FF, in order
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json(tok: ByteTokenizer) -> dict:
    """The ``tokenizer.json`` of ``ByteTokenizer``: ids 0..255 are the bytes, 256 the EOD."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": tok.eod_id, "content": EOD_TOKEN, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False,
                  "vocab": {c: b for b, c in byte_to_char().items()}, "merges": []},
    }


def tiktoken_tokenizer_json(tokenizer) -> dict:
    """The ``tokenizer.json`` of a ``TiktokenTokenizer``, from the tiktoken ``Encoding`` it
    encodes with (its ranks, split pattern and special tokens): ids are the ranks."""
    enc = tokenizer._enc
    ranks: dict[bytes, int] = enc._mergeable_ranks
    to_char = byte_to_char()

    def text(b: bytes) -> str:
        return "".join(to_char[x] for x in b)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        # Every split of the token into two ranked tokens, in the order tiktoken's lowest-rank-
        # first merging reaches them (a tokenizers BPE merges the lowest-ranked merge first).
        merges += sorted(((ranks[token[:i]], ranks[token[i:]], rank, text(token[:i]), text(token[i:]))
                          for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks),
                         key=lambda m: (m[2], m[0], m[1]))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t, i in sorted(enc._special_tokens.items())],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": enc._pat_str}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {text(t): r for t, r in ranks.items()}, "merges": [[a, b] for *_, a, b in merges]},
    }


def write_tokenizer(tokenizer, out: Path) -> None:
    """Write ``tokenizer_config.json`` (and ``tokenizer.json`` / the tokenizer's files) into ``out``."""
    tok = {"k3train_tokenizer": tokenizer.name, "k3train_tokenizer_kind": tokenizer.kind,
           "k3train_tokenizer_hash": tokenizer.files_hash, "vocab_size": tokenizer.vocab_size,
           "eos_token_id": tokenizer.eod_id}
    if isinstance(tokenizer, ByteTokenizer):
        (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(tokenizer), ensure_ascii=False))
        tok.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=EOD_TOKEN,
                   note="UTF-8 bytes are token ids 0..255 and 256 ends a document")
    else:
        src = Path(tokenizer.spec)
        files = sorted(p for p in src.iterdir() if p.is_file()) if src.is_dir() else [src]
        for f in files:
            shutil.copy2(f, out / f.name)
        tok["k3train_tokenizer_file"] = files[0].name if not src.is_dir() else "tokenizer.json"
        if tokenizer.kind == "hf":
            if not (out / "tokenizer.json").exists():
                shutil.copy2(files[0], out / "tokenizer.json")
            tok.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=tokenizer._tok.id_to_token(tokenizer.eod_id))
        elif tokenizer.kind == "tiktoken":
            (out / "tokenizer.json").write_text(json.dumps(tiktoken_tokenizer_json(tokenizer), ensure_ascii=False))
            eod = next(t for t, i in tokenizer._enc._special_tokens.items() if i == tokenizer.eod_id)
            tok.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=eod)
        else:
            tok["tokenizer_class"] = type(tokenizer).__name__
    # Special-token text inside a document is data to k3train's tokenizers, so here too.
    tok["split_special_tokens"] = True
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
