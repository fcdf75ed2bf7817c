"""Tokenize text files into a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``).

Inputs: ``.txt`` (the whole file is one document, or one per line with ``txt_split="lines"``, or
one per blank-line-separated paragraph with ``txt_split="blank-lines"``), ``.jsonl`` (one JSON
object per line, text in field ``text_key``), ``.parquet`` (column ``text_key``; needs pyarrow,
the ``parquet`` extra). Every document is stored
as one sequence that ends with the tokenizer's EOD token, so the ``.bin`` file read front to back
is the flat training stream ``doc0 EOD doc1 EOD ...``.

A sidecar ``<prefix>.meta.json`` records the tokenizer (kind, hash of its files, vocab size, EOD
id, spec), counts and the sha256 of the dataset's own bytes (``content_sha256``); readers check it so a dataset is never read with a tokenizer it was not
made with.

``workers > 1`` tokenizes in that many processes (chunks of documents, results taken in input
order, so the output is byte-identical to ``workers=1``). It is written last and
acts as the commit marker: everything is first written under temporary names and renamed into
place, so a crash never leaves a half-written dataset that a reader would accept.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import socket
import sys
from pathlib import Path
from collections import deque
from typing import Iterable, Iterator

import numpy as np

from k3train.data.tokenizer import load_tokenizer
from k3train.errors import DataError
from k3train.runtime.files import writable_ancestor_problem

__all__ = ["prepare_data", "prepare_documents", "content_sha256", "read_documents", "tokenizer_meta", "meta_path", "token_dtype",
           "ALLOWED_EXTENSIONS", "TXT_SPLITS"]

ALLOWED_EXTENSIONS = (".txt", ".jsonl", ".parquet")
META_FORMAT = "k3train-indexed-v1"
# Below this much input the run takes about a second and a progress bar is only noise.
_PROGRESS_MIN_BYTES = 16 * 2**20
# Characters per unit of work handed to the tokenizer (and to a worker process): large enough
# that a worker's round trip is cheap next to the encoding, small enough to keep memory flat.
_CHUNK_CHARS = 1 << 20


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


def check_inputs(inputs: list[str | Path]) -> list[Path]:
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


TXT_SPLITS = ("none", "lines", "blank-lines")
_BLANK_LINES = re.compile(r"\n[ \t\r]*\n\s*")


def _read_txt(path: Path, txt_split: str = "none") -> Iterator[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        msg = f"{path} is not valid UTF-8 (byte {e.start}); re-encode it as UTF-8"
        raise DataError(msg) from None
    if txt_split == "none":
        yield text
    elif txt_split == "lines":
        yield from text.splitlines()
    else:
        yield from _BLANK_LINES.split(text)


def _not_utf8(path: Path, e: UnicodeError) -> DataError:
    return DataError(f"{path} is not valid UTF-8 ({e.reason} at byte {e.start}); re-encode it as UTF-8")


def _read_jsonl(path: Path, text_key: str) -> Iterator[str]:
    try:
        yield from _read_jsonl_lines(path, text_key)
    except UnicodeDecodeError as e:  # raised by the line iterator, mid-file
        raise _not_utf8(path, e) from None


def _read_jsonl_lines(path: Path, text_key: str) -> Iterator[str]:
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
                    f"pass --text-key with the field that holds the text"
                )
            text = record[text_key]
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: field {text_key!r} (--text-key) is {type(text).__name__}, "
                    f"expected a string"
                )
            try:  # JSON escapes can spell a lone surrogate ("\\ud800"), which no tokenizer can encode
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(f"{path}:{lineno}: field {text_key!r} holds a lone surrogate escape "
                                f"(not valid Unicode text); fix or drop that line") from None
            yield text


def _read_parquet(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"reading {path} needs pyarrow, which is not installed: pip install 'k3train[parquet]'"
        ) from None
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    names = pf.schema_arrow.names
    if text_key not in names:
        raise DataError(
            f"{path}: no column {text_key!r} (found: {names}); pass --text-key with the text column"
        )
    # Record batches keep memory bounded for files much larger than RAM.
    for batch in pf.iter_batches(columns=[text_key]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def read_documents(path: Path, text_key: str = "text", txt_split: str = "none") -> Iterator[str]:
    """The documents of one input file, in file order (see the module docstring)."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _read_txt(path, txt_split)
    if suffix == ".jsonl":
        return _read_jsonl(path, text_key)
    return _read_parquet(path, text_key)


def content_sha256(bin_path: str | Path, idx_path: str | Path) -> str:
    """sha256 of a dataset's ``.bin`` bytes followed by its ``.idx`` bytes: the dataset's
    identity (recorded in its meta file as ``content_sha256``), whatever its path."""
    digest = hashlib.sha256()
    for path in (bin_path, idx_path):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


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


def _encode_chunk(tokenizer, texts: list[str], dtype) -> list[np.ndarray]:
    """Documents -> one id array each, EOD appended (the batch API where the library has one)."""
    eod = np.asarray([tokenizer.eod_id], dtype=dtype)
    if hasattr(tokenizer, "encode_array"):
        encoded = [tokenizer.encode_array(t) for t in texts]
    elif hasattr(tokenizer, "encode_batch"):
        encoded = tokenizer.encode_batch(texts)
    else:
        encoded = [tokenizer.encode(t) for t in texts]
    return [np.concatenate([np.asarray(ids, dtype=dtype), eod]) for ids in encoded]


_worker_tokenizer = None


def _worker_init(spec: str) -> None:
    global _worker_tokenizer  # one tokenizer per worker process, loaded once

    _worker_tokenizer = load_tokenizer(spec)


def _worker_encode(job: tuple[list[str], str]) -> list[np.ndarray]:
    texts, dtype = job
    return _encode_chunk(_worker_tokenizer, texts, np.dtype(dtype))


def _chunks(docs: Iterator[str], max_bytes: int, empty: list[int]) -> Iterator[list[str]]:
    """Non-empty documents grouped into lists of about ``max_bytes`` characters; ``empty[0]``
    counts the empty ones skipped."""
    chunk, size = [], 0
    for text in docs:
        if not text:
            empty[0] += 1
            continue
        chunk.append(text)
        size += len(text)
        if size >= max_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encoded_chunks(docs: Iterator[str], tokenizer, dtype, workers: int,
                    empty: list[int]) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    chunks = _chunks(docs, _CHUNK_CHARS, empty)
    if workers <= 1:
        for chunk in chunks:
            yield chunk, _encode_chunk(tokenizer, chunk, dtype)
        return
    # spawn: the parent may hold threads (torch, the tokenizer libraries) that fork would copy
    # in an unknown state. Results are taken in submission order, so the output equals
    # workers=1's; at most 2 chunks per worker are in flight, so memory stays bounded.
    with mp.get_context("spawn").Pool(workers, _worker_init, (tokenizer.spec,)) as pool:
        in_flight: deque = deque()
        for chunk in chunks:
            in_flight.append((chunk, pool.apply_async(_worker_encode, ((chunk, np.dtype(dtype).name),))))
            if len(in_flight) >= 2 * workers:
                done, result = in_flight.popleft()
                yield done, result.get()
        while in_flight:
            done, result = in_flight.popleft()
            yield done, result.get()


def tokenizer_meta(tokenizer) -> dict:
    """The tokenizer's identity as recorded in (and checked against) a dataset's meta file."""
    return {"tokenizer": tokenizer.name, "tokenizer_kind": tokenizer.kind,
            "tokenizer_files_hash": tokenizer.files_hash, "tokenizer_spec": tokenizer.spec,
            "vocab_size": int(tokenizer.vocab_size), "eod_id": int(tokenizer.eod_id)}


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def cap_workers(workers: int) -> int:
    """``workers`` bounded by ``available_cores()``: more processes than cores only add
    start-up cost and memory (``--workers 10000`` once forked without bound). A capped request
    says so in one line on stderr."""
    if workers < 1:
        raise DataError(f"--workers must be >= 1 (or 0 for automatic), got {workers}")
    cores = available_cores()
    if workers > cores:
        print(f"[prepare-data] --workers {workers} capped at {cores}, the cores available", file=sys.stderr)
        return cores
    return workers


def _existing_outputs(prefix: Path) -> list[Path]:
    return [p for p in (Path(f"{prefix}.bin"), Path(f"{prefix}.idx"), meta_path(prefix)) if p.exists()]


def check_output_prefix(prefix: Path, overwrite: bool) -> None:
    """Refuse, before any work and changing nothing, an output prefix that cannot be written or
    that holds a dataset (``overwrite`` not given): one ``DataError`` line."""
    existing = _existing_outputs(prefix)
    if existing and not overwrite:
        raise DataError(f"{existing[0]} exists (a prepared dataset at {prefix}); pass --overwrite to "
                        f"replace it, or choose another --output-prefix")
    for p in existing:
        if not p.is_file():
            raise DataError(f"{p} exists and is not a file; choose another --output-prefix")
    problem = writable_ancestor_problem(prefix.parent)
    if problem is not None:
        raise DataError(f"output prefix {prefix}: {problem}")


def _make_parents(parent: Path) -> list[Path]:
    """Create ``parent`` and its missing ancestors; returns those created (deepest first)."""
    missing = []
    for p in (parent, *parent.parents):
        if p.exists():
            break
        missing.append(p)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_dirs(missing)
        raise DataError(f"cannot create output directory {parent}: {e.strerror or e}") from None
    return missing


def _remove_dirs(created: list[Path]) -> None:
    for p in created:  # deepest first; a directory someone else filled meanwhile stays
        try:
            p.rmdir()
        except OSError:
            pass


def prepare_documents(
    documents: Iterable[str],
    output_prefix: str | Path,
    tokenizer,
    *,
    inputs: list[str] | None = None,
    total_bytes: int | None = None,
    progress: bool | None = None,
    workers: int = 1,
    overwrite: bool = False,
) -> dict:
    """Tokenize ``documents`` in order into ``<output_prefix>.{bin,idx,meta.json}``.

    Empty documents are skipped and counted (``empty_documents`` in the returned stats, not in
    the meta file). ``total_bytes`` (the input size, when known) sizes the progress bar;
    ``progress=None`` shows it when that is 16 MiB or more. ``workers`` is capped at the cores
    available. An existing dataset at the prefix is replaced only with ``overwrite``; any
    refusal or failure leaves the disk as it was. Returns the meta file's stats.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    workers = cap_workers(workers)
    prefix = Path(output_prefix)
    check_output_prefix(prefix, overwrite)
    created = _make_parents(prefix.parent)
    try:
        return _write_dataset(documents, prefix, tokenizer, inputs=inputs, total_bytes=total_bytes,
                              progress=progress, workers=workers, builder_cls=IndexedDatasetBuilder,
                              tqdm=tqdm)
    except BaseException:
        _remove_dirs(created)
        raise


def _write_dataset(documents, prefix: Path, tokenizer, *, inputs, total_bytes, progress, workers,
                   builder_cls, tqdm) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    if progress is None:
        progress = (total_bytes or 0) >= _PROGRESS_MIN_BYTES

    for path in remove_stale_temporaries(prefix):
        print(f"[prepare-data] removed {path}, left by an earlier run that was killed", file=sys.stderr)
    # The pid and host in the temporary name keep two concurrent runs from writing the same
    # files, and tell a later run whether the writer is gone.
    tmp = Path(f"{prefix}.tmp{os.getpid()}-{_this_host()}")
    tmp_bin, tmp_idx, tmp_meta = Path(f"{tmp}.bin"), Path(f"{tmp}.idx"), Path(f"{tmp}.meta.json")
    num_docs = num_tokens = 0
    empty = [0]
    builder = None
    try:
        try:
            builder = builder_cls(str(tmp_bin), dtype=dtype)
        except OSError as e:
            raise DataError(f"cannot write {tmp_bin}: {e.strerror or e}") from None
        # Bytes drive the bar (its rate is bytes/s); documents and tokens ride in the postfix.
        bar = tqdm(desc="tokenizing", total=total_bytes, unit="B", unit_scale=True, disable=not progress,
                   file=sys.stderr, mininterval=0.5)
        for texts, encoded in _encoded_chunks(iter(documents), tokenizer, dtype, workers, empty):
            for ids in encoded:
                builder.add_document(ids, [ids.size])
                num_tokens += ids.size
            num_docs += len(encoded)
            bar.update(sum(len(t.encode("utf-8")) for t in texts) if progress else 0)
            bar.set_postfix_str(f"{num_docs:,} docs, {num_tokens:,} tokens", refresh=False)
        if total_bytes and progress:  # split .txt lines drop their newlines: end the bar at 100%
            bar.n = total_bytes
            bar.refresh()
        bar.close()
        builder.finalize(str(tmp_idx))
        if num_docs == 0:
            names = ", ".join(inputs or [])
            raise DataError(f"no non-empty documents found in inputs: {names}")
        stats = {
            "format": META_FORMAT,
            **tokenizer_meta(tokenizer),
            "dtype": np.dtype(dtype).name,
            "num_documents": num_docs,
            "num_tokens": num_tokens,
            "inputs": list(inputs or []),
            # Read back once (much faster than the tokenizing): tells re-prepared data at the
            # same prefix apart from the data a checkpoint was trained on.
            "content_sha256": content_sha256(tmp_bin, tmp_idx),
        }
        tmp_meta.write_text(json.dumps(stats, indent=2) + "\n")
        # Drop the old commit marker first: between the renames below the final names may hold
        # a mix of old and new files, and readers refuse a prefix without its meta file.
        _remove_quietly(meta_path(prefix))
        os.replace(tmp_bin, f"{prefix}.bin")
        os.replace(tmp_idx, f"{prefix}.idx")
        os.replace(tmp_meta, meta_path(prefix))
    except OSError as e:  # disk full, permissions changed under us: one line, temporaries removed
        raise DataError(f"preparing the dataset {prefix} failed: {e.strerror or e}"
                        f"{f' ({e.filename})' if e.filename else ''}") from None
    finally:
        if builder is not None:
            builder.data_file.close()  # a no-op after finalize; needed when reading failed
        _remove_quietly(tmp_bin, tmp_idx, tmp_meta)
    return {**stats, "empty_documents": empty[0]}


def auto_workers(total_bytes: int) -> int:
    """Worker processes for ``--workers 0``: one below 16 MiB of input (starting workers costs
    more than it saves), else one per CPU core up to 8."""
    if total_bytes < _PROGRESS_MIN_BYTES:
        return 1
    return max(1, min(8, available_cores()))


def prepare_data(
    inputs: list[str | Path],
    output_prefix: str | Path,
    tokenizer,
    text_key: str = "text",
    progress: bool | None = None,
    *,
    txt_split: str = "none",
    workers: int = 1,
    overwrite: bool = False,
) -> dict:
    """Tokenize the files ``inputs`` in order into ``<output_prefix>.{bin,idx,meta.json}``.

    ``txt_split``: how a ``.txt`` file becomes documents (one of ``TXT_SPLITS``). ``workers``:
    tokenizer processes (0 = ``auto_workers``; capped at the cores available). ``overwrite``:
    replace a dataset already at ``output_prefix`` (refused otherwise, before any work). Returns the stats written to the meta file:
    ``tokenizer``, ``tokenizer_kind``, ``tokenizer_files_hash``, ``tokenizer_spec``,
    ``vocab_size``, ``eod_id``, ``dtype``, ``num_documents``, ``num_tokens``, ``inputs``, ``content_sha256`` (``content_sha256()``), plus ``empty_documents`` (skipped; not in the
    meta file).
    """
    if txt_split not in TXT_SPLITS:
        raise DataError(f"txt_split {txt_split!r}; allowed: {', '.join(TXT_SPLITS)}")
    paths = check_inputs(list(inputs))
    check_output_prefix(Path(output_prefix), overwrite)
    total = sum(p.stat().st_size for p in paths)
    workers = auto_workers(total) if workers == 0 else workers

    def documents() -> Iterator[str]:
        for path in paths:
            yield from read_documents(path, text_key, txt_split)

    return prepare_documents(documents(), output_prefix, tokenizer, inputs=[str(p) for p in paths],
                             total_bytes=total, progress=progress, workers=workers, overwrite=overwrite)
