"""Token streams, fixed-length windows and deterministic, resumable batching.

``TokenSource`` is a flat token stream ``doc0 EOD doc1 EOD ...`` ([N] numpy ints), split into
train/val by position: the last ``val_fraction`` of the tokens is validation. Cutting by position
gives exact split sizes whatever the document lengths and works for a single-document corpus; at
most one document straddles the cut.

``SequenceDataset`` cuts the stream into non-overlapping windows of ``seq_len + 1`` tokens (inputs
are ``w[:-1]``, targets ``w[1:]``); windows may span document boundaries, the EOD token marks them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from k3train.errors import DataError
from k3train.data.corpus import embedded_documents
from k3train.data.prepare import META_FORMAT, meta_path
from k3train.data.tokenizer import ByteTokenizer

__all__ = ["TokenSource", "SequenceDataset", "BatchIterator", "eval_batches", "dataset_content_hash"]

_SPLITS = ("train", "val", "all")
_IDX_MAGIC = b"MMIDIDX\x00\x00"  # first bytes of every megatron-core .idx file
# Token-id range check when a prepared dataset is opened: streams up to this many tokens are
# scanned whole (~10 ms per 16M uint16 tokens); longer ones in _SAMPLES evenly spaced chunks of
# _SAMPLE_TOKENS, the first and the last included.
_FULL_SCAN_TOKENS = 1 << 24
_SAMPLES, _SAMPLE_TOKENS = 64, 1 << 18


def check_token_range(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Raise DataError if ``tokens`` [N] (scanned whole, or sampled when long) holds an id
    outside ``[0, vocab_size)``: such an id either indexes past the embedding (an IndexError
    deep in the model) or trains on rows no tokenizer produces."""
    n = len(tokens)
    if n <= _FULL_SCAN_TOKENS:
        starts = [0]
        width = n
    else:
        starts = np.linspace(0, n - _SAMPLE_TOKENS, _SAMPLES).astype(np.int64).tolist()
        width = _SAMPLE_TOKENS
    for start in starts:
        chunk = np.asarray(tokens[start:start + width])
        bad = np.flatnonzero((chunk >= vocab_size) | (chunk < 0)) if chunk.size else []
        if len(bad):
            i = int(bad[0])
            raise DataError(f"{where} holds token id {int(chunk[i])} at position {start + i}, outside the "
                            f"vocabulary [0, {vocab_size}) it was prepared with; the file is corrupt or "
                            f"was not written by `k3train prepare-data`: re-run it")


def _split(tokens: np.ndarray, split: str, val_fraction: float) -> np.ndarray:
    if split not in _SPLITS:
        raise DataError(f"unknown split {split!r}; allowed: 'train', 'val', 'all'")
    if split == "all":
        return tokens
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut] if split == "train" else tokens[cut:]


class TokenSource:
    """A flat 1-D token stream: ``tokens`` [N] (numpy ints, possibly a read-only memmap).

    ``marks_documents``: whether an end-of-document token ends every document of the stream
    (what ``data.document_mask`` reads the boundaries from): true for the built-in corpora and
    for datasets ``prepare-data`` wrote; for a foreign Megatron dataset, whether it was made with
    EOD tokens appended."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, description: str = "",
                 marks_documents: bool = True) -> None:
        if tokens.ndim != 1:
            raise DataError(f"tokens must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.vocab_size = int(vocab_size)
        self.description = description
        self.marks_documents = bool(marks_documents)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"TokenSource({self.description}, {len(self)} tokens)"

    @classmethod
    def embedded(cls, tokenizer, split: str = "train", val_fraction: float = 0.05) -> "TokenSource":
        """The pydoc-topics corpus (see ``corpus.py``), tokenized in memory (~466k byte tokens)."""
        ids: list[int] = []
        for doc in embedded_documents():
            ids.extend(tokenizer.encode(doc))
            ids.append(tokenizer.eod_id)
        tokens = np.asarray(ids, dtype=np.int64)
        return cls(_split(tokens, split, val_fraction), tokenizer.vocab_size, f"embedded:{split}")

    @classmethod
    def from_prefix(
        cls, prefix: str | Path, tokenizer, split: str = "train", val_fraction: float = 0.05,
        allow_foreign: bool = False,
    ) -> "TokenSource":
        """A dataset written by ``prepare_data``; the token stream is memory-mapped, not copied.

        ``allow_foreign``: a ``.bin/.idx`` pair without k3train's meta file (a Megatron dataset
        made elsewhere) is read as tokens of ``tokenizer``, which the caller has been told by the
        user; its ids are still checked against ``tokenizer.vocab_size``. ``split="all"``: the
        whole stream."""
        prefix = str(prefix)
        bin_path, idx_path, meta = Path(prefix + ".bin"), Path(prefix + ".idx"), meta_path(prefix)
        for p in (bin_path, idx_path):
            if not p.is_file():
                raise DataError(
                    f"no prepared dataset at {prefix}: {p} is missing; run `k3train prepare-data`"
                )
        if not meta.is_file():
            if allow_foreign:
                tokens, marked = _open_foreign(prefix, tokenizer)
                return cls(_split(tokens, split, val_fraction), tokenizer.vocab_size, f"{prefix}:{split}",
                           marks_documents=marked)
            raise DataError(
                f"{meta} is missing: {prefix} was not prepared by k3train or its preparation "
                f"did not finish; re-run `k3train prepare-data`, or for a Megatron dataset made "
                f"elsewhere name its tokenizer with data.tokenizer=..."
            )
        try:
            info = json.loads(meta.read_text())
            vocab, eod = int(info["vocab_size"]), int(info["eod_id"])
            dtype = np.dtype(info["dtype"])
            n_tok, n_doc = int(info["num_tokens"]), int(info["num_documents"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{meta} is not a valid k3train dataset meta file ({e!r})") from None
        if info.get("format") != META_FORMAT:
            raise DataError(f"{meta}: format {info.get('format')!r}, expected {META_FORMAT!r}")
        check_same_tokenizer(info, tokenizer, prefix)

        # Sizes first: megatron's reader would fail on a short file with a bare numpy error.
        # The .idx layout (34-byte header, int32 lengths, int64 pointers, int64 document
        # indices) holds one sequence per document, as prepare_data writes it.
        expected = {bin_path: n_tok * dtype.itemsize, idx_path: 34 + 12 * n_doc + 8 * (n_doc + 1)}
        for p, size in expected.items():
            actual = os.path.getsize(p)
            if actual != size:
                raise DataError(
                    f"{p} is truncated or corrupt: {actual} bytes, expected {size} from {meta}; "
                    f"re-run `k3train prepare-data`"
                )
        index_dtype, lengths = _read_index(prefix)
        if index_dtype != dtype or len(lengths) != n_doc or int(lengths.sum()) != n_tok:
            raise DataError(
                f"{idx_path} disagrees with {meta} (dtype {index_dtype} vs {dtype}, "
                f"{len(lengths)} vs {n_doc} documents, {int(lengths.sum())} vs {n_tok} tokens); "
                f"re-run `k3train prepare-data`"
            )
        # Documents are stored back to back, so the .bin file is the concatenated stream.
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tok,))
        check_token_range(tokens, vocab, str(bin_path))
        return cls(_split(tokens, split, val_fraction), vocab, f"{prefix}:{split}")


def dataset_content_hash(prefix: str | Path) -> str | None:
    """The ``content_sha256`` that ``prepare_data`` recorded for the dataset at ``prefix`` (sha256
    of its ``.bin`` then ``.idx`` bytes); None for a dataset without one (prepared by an older
    version, or a Megatron dataset without k3train's meta file)."""
    try:
        info = json.loads(meta_path(prefix).read_text())
    except (OSError, ValueError):
        return None
    value = info.get("content_sha256") if isinstance(info, dict) else None
    return value if isinstance(value, str) else None


def meta_tokenizer(info: dict) -> tuple[str, str | None]:
    """(kind, files hash) a meta file records; meta files from before subword tokenizers name
    only ``tokenizer: byte``."""
    kind = info.get("tokenizer_kind", info.get("tokenizer"))
    files_hash = info.get("tokenizer_files_hash", ByteTokenizer.files_hash if kind == "byte" else None)
    return kind, files_hash


def check_same_tokenizer(info: dict, tokenizer, prefix: str) -> None:
    """DataError in one line naming both tokenizers unless ``tokenizer`` is the one the dataset
    whose meta is ``info`` was prepared with (same kind, file hash, vocab size and EOD id)."""
    kind, files_hash = meta_tokenizer(info)
    vocab, eod = info.get("vocab_size"), info.get("eod_id")
    if (kind, files_hash, vocab, eod) != (tokenizer.kind, tokenizer.files_hash, tokenizer.vocab_size,
                                          tokenizer.eod_id):
        name = info.get("tokenizer_spec") or info.get("tokenizer")
        raise DataError(
            f"{prefix} was prepared with tokenizer {name!r} ({kind}, hash {str(files_hash)[:12]}, "
            f"vocab {vocab}, eod {eod}) but this run uses {tokenizer.name!r} ({tokenizer.kind}, hash "
            f"{tokenizer.files_hash[:12]}, vocab {tokenizer.vocab_size}, eod {tokenizer.eod_id}); "
            f"re-run `k3train prepare-data` with the run's tokenizer or set data.tokenizer to the dataset's"
        )


def _read_index(prefix: str) -> tuple[np.dtype, np.ndarray]:
    """(token dtype, sequence lengths [S]) from ``prefix.idx``, with one-line errors."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    idx_path = prefix + ".idx"
    with open(idx_path, "rb") as f:
        # Checked here because megatron's reader asserts on a bad header and then raises
        # again from its own __del__, which buries the message.
        if f.read(len(_IDX_MAGIC)) != _IDX_MAGIC:
            raise DataError(f"{idx_path} is not a Megatron index file (bad header)")
    try:
        ds = IndexedDataset(prefix, mmap=True)
        lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
        index_dtype = np.dtype(ds.index.dtype)
        del ds
    except (AssertionError, ValueError, OSError) as e:
        raise DataError(f"{idx_path} is corrupt ({e}); re-run `k3train prepare-data`") from None
    return index_dtype, lengths


# How many of a foreign dataset's documents are checked for a closing EOD token.
_EOD_PROBES = 64


def _open_foreign(prefix: str, tokenizer) -> tuple[np.ndarray, bool]:
    """(the token stream, whether EOD tokens end its documents) of a Megatron ``.bin/.idx`` that
    k3train did not write.

    Megatron's builder stores sequences back to back, so the ``.bin`` file read front to back is
    the stream; documents are separated only if the tool that wrote it appended EOD tokens
    (Megatron's ``preprocess_data.py --append-eod``): the last token of the first
    ``_EOD_PROBES`` documents (by the ``.idx`` lengths) tells."""
    dtype, lengths = _read_index(prefix)
    bin_path = prefix + ".bin"
    n_tok = int(lengths.sum())
    if os.path.getsize(bin_path) != n_tok * dtype.itemsize:
        raise DataError(f"{bin_path} is truncated or corrupt: {os.path.getsize(bin_path)} bytes, but "
                        f"{prefix}.idx lists {n_tok} {dtype.name} tokens ({n_tok * dtype.itemsize} bytes)")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tok,))
    try:
        check_token_range(tokens, tokenizer.vocab_size, bin_path)
    except DataError:
        raise DataError(f"{bin_path} holds token ids outside [0, {tokenizer.vocab_size}) of data.tokenizer "
                        f"{tokenizer.name!r}: it was made with another tokenizer; name that one") from None
    ends = np.cumsum(lengths[:_EOD_PROBES]) - 1
    marked = bool(len(ends)) and bool((np.asarray(tokens[ends]) == tokenizer.eod_id).all())
    return tokens, marked


class SequenceDataset(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens with stride ``seq_len``.

    Window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; consecutive windows share one
    token so every token of the stream is a prediction target exactly once.
    """

    def __init__(self, source: TokenSource, seq_len: int) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = source.tokens
        self.seq_len = int(seq_len)
        self._len = (len(self.tokens) - 1) // self.seq_len
        if self._len < 1:
            raise DataError(
                f"{source!r} has {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}"
            )
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> torch.Tensor:
        """-> LongTensor [seq_len + 1]."""
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range [0, {self._len})")
        start = int(i) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return torch.from_numpy(np.asarray(window, dtype=np.int64))

    def batch(self, indices) -> torch.Tensor:
        """Windows ``indices`` [B] stacked -> LongTensor [B, seq_len + 1] (one gather, no loop)."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        windows = self.tokens[starts[:, None] + self._offsets]
        return torch.from_numpy(np.asarray(windows, dtype=np.int64))


class BatchIterator:
    """Infinite, deterministic, resumable batches from a ``SequenceDataset``.

    Epoch ``e`` visits the windows in the order ``default_rng(seed + e).permutation(len(dataset))``.
    Each step consumes one global batch of ``batch_size * world_size`` consecutive entries of that
    permutation; data-parallel rank ``r`` takes entries ``[r*batch_size, (r+1)*batch_size)`` of it,
    so ranks are disjoint and their union is the world_size=1 batch of ``batch_size*world_size``.
    A tail shorter than a global batch is dropped and the next epoch starts.

    ``next(it)`` -> LongTensor [batch_size, seq_len + 1].
    """

    def __init__(
        self,
        dataset: SequenceDataset,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise DataError(
                f"need batch_size >= 1 and 0 <= rank < world_size, "
                f"got batch_size={batch_size}, rank={rank}, world_size={world_size}"
            )
        self.global_batch = batch_size * world_size
        if len(dataset) < self.global_batch:
            raise DataError(
                f"dataset has {len(dataset)} windows, fewer than one global batch "
                f"(batch_size {batch_size} x world_size {world_size}); "
                f"use a smaller batch or seq_len"
            )
        self.dataset, self.batch_size = dataset, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.epoch, self.position = int(seed), 0, 0
        self._perm: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache

    def _permutation(self) -> np.ndarray:
        if self._perm is None or self._perm[0] != self.epoch:
            rng = np.random.default_rng(self.seed + self.epoch)
            self._perm = (self.epoch, rng.permutation(len(self.dataset)))
        return self._perm[1]

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> torch.Tensor:
        if self.position + self.global_batch > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position + self.rank * self.batch_size
        indices = self._permutation()[start : start + self.batch_size]
        self.position += self.global_batch
        return self.dataset.batch(indices)

    def state_dict(self) -> dict:
        """``{"epoch", "position", "seed"}``; ``position`` counts windows (rank-independent)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise DataError(f"BatchIterator state is missing {sorted(missing)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed = int(state["seed"])
        self._perm = None


def eval_batches(dataset: SequenceDataset, batch_size: int, max_batches: int) -> list[torch.Tensor]:
    """The first ``min(max_batches, len(dataset) // batch_size)`` batches of windows, in order.

    Each is LongTensor [batch_size, seq_len + 1]. If the dataset is smaller than one batch, a
    single batch of all its windows is returned so evaluation never silently does nothing.
    """
    if batch_size < 1 or max_batches < 1:
        raise DataError(
            f"batch_size and max_batches must be >= 1, got {batch_size}, {max_batches}"
        )
    n = min(max_batches, len(dataset) // batch_size)
    if n == 0:
        return [dataset.batch(np.arange(len(dataset)))]
    return [dataset.batch(np.arange(b * batch_size, (b + 1) * batch_size)) for b in range(n)]
