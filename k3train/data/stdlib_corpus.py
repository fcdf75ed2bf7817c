"""``data.source=stdlib``: the Python standard library's own ``.py`` files as a training corpus.

Every Python install ships them (``sysconfig.get_paths()["stdlib"]``), so this corpus needs no
download, and it is about 100x larger than the embedded pydoc topics.

What is in it, chosen so that two machines with the same Python version get the same corpus:

* every ``*.py`` file under the stdlib directory, one document per file, in sorted order of
  their relative POSIX paths (directory listings come in filesystem order);
* left out: ``site-packages`` / ``dist-packages`` (installed third-party code, different on
  every machine), ``__pycache__``, and test directories (any path part named ``test``,
  ``tests`` or ``idle_test``): distributions often ship them separately or not at all (Debian's
  ``libpython3-testsuite``), and they hold deliberately malformed and non-UTF-8 files;
* files that are not valid UTF-8 are skipped (there are none outside the test directories on
  CPython 3.11).

Train/validation split by file: a file is validation when the first 8 hex digits of the SHA-256
of its relative path, as a fraction of 16**8, are below ``val_fraction``. Adding or removing one
file never moves another between splits.

The prepared token streams are cached (``prepare_stdlib``) under ``data.cache_dir`` keyed by
the Python version, a hash of the file list and contents, the split fraction and the
tokenizer's hash, so a run tokenizes the corpus once per machine.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from k3train.data.prepare import meta_path, prepare_documents
from k3train.errors import DataError

__all__ = ["stdlib_files", "stdlib_documents", "prepare_stdlib", "default_cache_dir", "is_val_file"]

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[tuple[str, Path]]:
    """``(relative POSIX path, absolute path)`` of every corpus file, sorted by relative path."""
    root = stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            out.append((rel.as_posix(), path))
    if not out:
        raise DataError(f"no .py files under the standard library directory {root}")
    return sorted(out)


def is_val_file(rel: str, val_fraction: float) -> bool:
    """Whether the file at relative path ``rel`` belongs to the validation split."""
    h = int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8], 16)
    return h < val_fraction * 16**8


def stdlib_documents(split: str = "train", val_fraction: float = 0.05) -> Iterator[tuple[str, str]]:
    """``(relative path, text)`` of the ``split`` ("train" or "val") files, in sorted order."""
    if split not in ("train", "val"):
        raise DataError(f"unknown split {split!r}; allowed: 'train', 'val'")
    for rel, path in stdlib_files():
        if is_val_file(rel, val_fraction) != (split == "val"):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            yield rel, text


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/k3train``, or ``~/.cache/k3train`` (the usual per-user cache place)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k3train"


@functools.lru_cache(maxsize=4)  # reading every file costs seconds; train and val share it
def _corpus_key(val_fraction: float) -> str:
    h = hashlib.sha256(f"{platform.python_version()}|{val_fraction!r}".encode())
    for rel, path in stdlib_files():
        h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def prepare_stdlib(tokenizer, val_fraction: float = 0.05, cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Tokenize the corpus once into ``{"train": prefix, "val": prefix}`` under the cache dir.

    A prefix whose meta file exists is reused (prepare_data writes the meta file last, so its
    presence means the dataset is complete). Concurrent ranks may both write; each writes under
    its own temporary names and renames, so the result is one complete copy either way.
    """

    ver = ".".join(platform.python_version_tuple()[:2])
    key = f"py{ver}-{_corpus_key(val_fraction)}-{tokenizer.kind}-{tokenizer.files_hash[:12]}"
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = {}
    for split in ("train", "val"):
        prefix = root / "stdlib" / key / split
        if not meta_path(prefix).is_file():
            print(f"[k3train] tokenizing the standard library's {split} files into {prefix} (once)",
                  file=sys.stderr)
            docs = (text for _, text in stdlib_documents(split, val_fraction))
            prepare_documents(docs, prefix, tokenizer, inputs=[f"stdlib:{split}"])
        out[split] = prefix
    return out

