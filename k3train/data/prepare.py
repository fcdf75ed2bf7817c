"""Tokenize text files into a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``).

Inputs: ``.txt`` (the whole file is one document), ``.jsonl`` (one JSON object per line, text in
field ``text_key``), ``.parquet`` (column ``text_key``; needs pyarrow). Every document is stored
as one sequence that ends with the tokenizer's EOD token, so the ``.bin`` file read front to back
is the flat training stream ``doc0 EOD doc1 EOD ...``.

A sidecar ``<prefix>.meta.json`` records the tokenizer name, vocab size and counts; readers check
it so a dataset is never read with a tokenizer it was not made with. It is written last and
acts as the commit marker: everything is first written under temporary names and renamed into
place, so a crash never leaves a half-written dataset that a reader would accept.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from k3train.errors import DataError

__all__ = ["prepare_data", "meta_path", "token_dtype", "ALLOWED_EXTENSIONS"]

ALLOWED_EXTENSIONS = (".txt", ".jsonl", ".parquet")
META_FORMAT = "k3train-indexed-v1"
# Below this much input the run takes about a second and a progress bar is only noise.
_PROGRESS_MIN_BYTES = 16 * 2**20


def meta_path(prefix: str | Path) -> Path:
    """``<prefix>.meta.json``: the sidecar describing a prepared dataset."""
    return Path(f"{prefix}.meta.json")


def token_dtype(vocab_size: int) -> type[np.number]:
    """Smallest unsigned/signed dtype megatron's index format supports that holds every id."""
    if vocab_size <= 2**8:
        return np.uint8
    if vocab_size <= 2**16:
        return np.uint16
    if vocab_size <= 2**31:
        return np.int32
    raise DataError(f"vocab size {vocab_size} does not fit the indexed dataset's int32 tokens")


def _check_inputs(inputs: list[str | Path]) -> list[Path]:
    """Fail before any work on a missing file or an extension we cannot read."""
    if not inputs:
        raise DataError("prepare_data needs at least one input file (.txt, .jsonl or .parquet)")
    paths = [Path(p) for p in inputs]
    allowed = ", ".join(ALLOWED_EXTENSIONS)
    for p in paths:
        if not p.exists():
            raise DataError(f"input file not found: {p}")
        if not p.is_file():
            raise DataError(f"input {p} is not a file; pass files with extension {allowed}")
        if p.suffix.lower() not in ALLOWED_EXTENSIONS:
            raise DataError(
                f"input {p} has unsupported extension {p.suffix!r}; allowed: {allowed}"
            )
    return paths


def _read_txt(path: Path) -> Iterator[str]:
    try:
        yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        msg = f"{path} is not valid UTF-8 (byte {e.start}); re-encode it as UTF-8"
        raise DataError(msg) from None


def _read_jsonl(path: Path, text_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_key not in record:
                if isinstance(record, dict):
                    found = f"found: {sorted(record)}"
                else:
                    found = f"the line is a JSON {type(record).__name__}, not an object"
                raise DataError(
                    f"{path}:{lineno}: no field {text_key!r} ({found}); "
                    f"set text_key to the field that holds the text"
                )
            text = record[text_key]
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: field {text_key!r} is {type(text).__name__}, "
                    f"expected a string"
                )
            yield text


def _read_parquet(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if text_key not in names:
        raise DataError(
            f"{path}: no column {text_key!r} (found: {names}); set text_key to the text column"
        )
    # Record batches keep memory bounded for files much larger than RAM.
    for batch in pf.iter_batches(columns=[text_key]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _documents(path: Path, text_key: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _read_txt(path)
    if suffix == ".jsonl":
        return _read_jsonl(path, text_key)
    return _read_parquet(path, text_key)


def _remove_quietly(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _this_host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(prefix: Path) -> list[Path]:
    """Delete ``PREFIX.tmp<pid>-<host>.{bin,idx,meta.json}`` left by a killed prepare-data run
    (up to the whole token stream each) whose process is gone; returns what was removed.

    Files of a process still running, or of another host (a shared filesystem: its pid means
    nothing here), are left alone. Names without a host come from older versions, written on
    this host or not; they are treated as this host's."""
    pattern = re.compile(rf"^{re.escape(prefix.name)}\.tmp(\d+)(?:-([A-Za-z0-9_-]+))?\.(bin|idx|meta\.json)$")
    host, removed = _this_host(), []
    if not prefix.parent.is_dir():
        return removed
    for path in sorted(prefix.parent.iterdir()):
        m = pattern.match(path.name)
        if m and m.group(2) in (None, host) and int(m.group(1)) != os.getpid() and not _running(int(m.group(1))):
            _remove_quietly(path)
            removed.append(path)
    return removed


def prepare_data(
    inputs: list[str | Path],
    output_prefix: str | Path,
    tokenizer,
    text_key: str = "text",
    progress: bool | None = None,
) -> dict:
    """Tokenize ``inputs`` in order into ``<output_prefix>.{bin,idx,meta.json}``.

    Empty documents are skipped. ``progress=None`` shows a tqdm bar when the inputs total more
    than 16 MiB. Returns the stats written to the meta file: ``tokenizer``, ``vocab_size``,
    ``eod_id``, ``dtype``, ``num_documents``, ``num_tokens``, ``inputs``.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    paths = _check_inputs(list(inputs))
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    if progress is None:
        progress = sum(p.stat().st_size for p in paths) >= _PROGRESS_MIN_BYTES

    for path in remove_stale_temporaries(prefix):
        print(f"[prepare-data] removed {path}, left by an earlier run that was killed", file=sys.stderr)
    # The pid and host in the temporary name keep two concurrent runs from writing the same
    # files, and tell a later run whether the writer is gone.
    tmp = Path(f"{prefix}.tmp{os.getpid()}-{_this_host()}")
    tmp_bin, tmp_idx, tmp_meta = Path(f"{tmp}.bin"), Path(f"{tmp}.idx"), Path(f"{tmp}.meta.json")
    num_docs = num_tokens = 0
    builder = None
    try:
        builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
        bar = tqdm(desc="tokenizing", unit="doc", disable=not progress, file=sys.stderr)
        for path in paths:
            bar.set_postfix_str(path.name)
            for text in _documents(path, text_key):
                if not text:
                    continue
                ids = np.asarray(tokenizer.encode(text) + [tokenizer.eod_id], dtype=dtype)
                builder.add_document(ids, [ids.size])
                num_docs += 1
                num_tokens += ids.size
                bar.update(1)
        bar.close()
        builder.finalize(str(tmp_idx))
        if num_docs == 0:
            names = ", ".join(str(p) for p in paths)
            raise DataError(f"no non-empty documents found in inputs: {names}")
        stats = {
            "format": META_FORMAT,
            "tokenizer": tokenizer.name,
            "vocab_size": int(tokenizer.vocab_size),
            "eod_id": int(tokenizer.eod_id),
            "dtype": np.dtype(dtype).name,
            "num_documents": num_docs,
            "num_tokens": num_tokens,
            "inputs": [str(p) for p in paths],
        }
        tmp_meta.write_text(json.dumps(stats, indent=2) + "\n")
        # Drop the old commit marker first: between the renames below the final names may hold
        # a mix of old and new files, and readers refuse a prefix without its meta file.
        _remove_quietly(meta_path(prefix))
        os.replace(tmp_bin, f"{prefix}.bin")
        os.replace(tmp_idx, f"{prefix}.idx")
        os.replace(tmp_meta, meta_path(prefix))
    finally:
        if builder is not None:
            builder.data_file.close()  # a no-op after finalize; needed when reading failed
        _remove_quietly(tmp_bin, tmp_idx, tmp_meta)
    return stats
