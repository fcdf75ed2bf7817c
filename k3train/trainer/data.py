"""Build the run's token streams from the config: train batches and fixed validation batches."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from k3train.errors import DataError
from k3train.config import RunConfig
from k3train.data import BatchIterator, SequenceDataset, TokenSource, eval_batches, load_tokenizer
from k3train.data.documents import WindowDocuments
from k3train.data.mixture import MixtureBatchIterator
from k3train.data.prepare import meta_path
from k3train.data.stdlib_corpus import prepare_stdlib
from k3train.data.tokenizer import ByteTokenizer
from k3train.data.mqar import MQARBatchIterator, check_mqar_fits, mqar_targets, mqar_val_batches


def next_token_targets(windows: torch.Tensor) -> torch.Tensor:
    """windows [B, T + 1] -> targets [B, T]: every next token is a target."""
    return windows[:, 1:]


def no_documents(windows: torch.Tensor) -> None:
    """One sequence per window: no document boundaries (data.document_mask=false, MQAR)."""
    return None


@dataclass
class RunData:
    train: BatchIterator | MQARBatchIterator | MixtureBatchIterator
    """next() -> LongTensor [micro_batch_size * microbatches, seq_len + 1] for this DP rank."""
    val: list[torch.Tensor]
    """Fixed validation batches, each [micro_batch_size, seq_len + 1]."""
    description: str
    targets: Callable[[torch.Tensor], torch.Tensor] = field(default=next_token_targets)
    """windows [B, T + 1] -> targets [B, T] for the loss (inputs are always ``windows[:, :-1]``);
    masked positions hold -100, which ``F.cross_entropy`` ignores. Text data: ``windows[:, 1:]``."""
    documents: Callable[[torch.Tensor], torch.Tensor | None] = field(default=no_documents)
    """windows [B, T + 1] -> the document boundaries of their inputs (``cu_seqlens`` [N+1] over the
    flattened B*T inputs, k3train/data/documents.py) under data.document_mask, else None."""


def _build_mqar(cfg: RunConfig, dp_rank: int, dp_size: int) -> RunData:
    t, mq = cfg.train, cfg.data.mqar
    check_mqar_fits(mq, t.seq_len, cfg.model.vocab_size)
    it = MQARBatchIterator(mq, t.seq_len, t.micro_batch_size * t.microbatches, seed=t.seed,
                           rank=dp_rank, world_size=dp_size)
    val = mqar_val_batches(mq, t.seq_len, t.micro_batch_size, t.eval_batches)
    desc = (f"MQAR: {mq.num_pairs} pairs, {mq.queries} queries per window of {t.seq_len + 1}, "
            f"keys {list(mq.key_range)}, values {list(mq.value_range)}, val seed {mq.val_seed}")
    return RunData(it, val, desc, targets=partial(mqar_targets, cfg=mq))


_BUILT_IN = ("embedded", "stdlib")


def run_tokenizer(cfg: RunConfig):
    """The tokenizer a text run uses: ``data.tokenizer`` when set, else the one the first
    prepared dataset's meta file records, else ``byte``."""
    if cfg.data.tokenizer:
        return load_tokenizer(cfg.data.tokenizer)
    paths = [s.path for s in cfg.data.sources] or [cfg.data.source]
    for path in paths:
        if path in _BUILT_IN:
            continue
        meta = meta_path(path)
        if not meta.is_file():
            if Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file():
                raise DataError(f"{path} has no {meta.name} (a Megatron dataset k3train did not write, or an "
                                f"unfinished prepare-data run): name its tokenizer with data.tokenizer=...")
            return ByteTokenizer()  # from_prefix names what is missing
        try:
            spec = json.loads(meta.read_text()).get("tokenizer_spec", "byte")
        except ValueError:
            return ByteTokenizer()  # from_prefix reports the bad meta file
        if spec != "byte" and not Path(spec).exists():
            raise DataError(f"{path} was prepared with tokenizer {spec}, which is not on this machine; "
                            f"set data.tokenizer to a copy of it")
        return load_tokenizer(spec)
    return ByteTokenizer()


def _open(path: str, tokenizer, cfg: RunConfig, split: str) -> TokenSource:
    vf = cfg.data.val_fraction
    if path == "embedded":
        return TokenSource.embedded(tokenizer, split, vf)
    if path == "stdlib":
        prefixes = prepare_stdlib(tokenizer, vf, cfg.data.cache_dir or None)
        src = TokenSource.from_prefix(prefixes[split], tokenizer, "all")
        src.description = f"stdlib:{split}"
        return src
    foreign = bool(cfg.data.tokenizer) and not meta_path(path).is_file()
    src = TokenSource.from_prefix(path, tokenizer, split, vf, allow_foreign=foreign)
    if cfg.data.masks_documents and not src.marks_documents:
        raise DataError(f"data.document_mask=true needs document boundaries, but {path} has no end-of-document "
                        f"token ({tokenizer.eod_id}) closing its documents (made without --append-eod?); "
                        f"re-prepare it with `k3train prepare-data` or set data.document_mask=false")
    return src


def _documents(cfg: RunConfig, tokenizer):
    """RunData.documents of a text run."""
    return WindowDocuments(tokenizer.eod_id) if cfg.data.masks_documents else no_documents


def build_data(cfg: RunConfig, dp_rank: int = 0, dp_size: int = 1) -> RunData:
    if cfg.data.source == "mqar" and not cfg.data.sources:
        return _build_mqar(cfg, dp_rank, dp_size)
    tokenizer = run_tokenizer(cfg)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise DataError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of tokenizer "
            f"{tokenizer.name!r} ({tokenizer.vocab_size}); set model.vocab_size >= {tokenizer.vocab_size}")
    t = cfg.train
    batch = t.micro_batch_size * t.microbatches
    if not cfg.data.sources:
        train_src, val_src = (_open(cfg.data.source, tokenizer, cfg, s) for s in ("train", "val"))
        train_ds, val_ds = SequenceDataset(train_src, t.seq_len), SequenceDataset(val_src, t.seq_len)
        it = BatchIterator(train_ds, batch, seed=t.seed, rank=dp_rank, world_size=dp_size)
        val = eval_batches(val_ds, t.micro_batch_size, t.eval_batches)
        desc = (f"{train_src!r}: {len(train_src):,} train tokens ({len(train_ds):,} windows of {t.seq_len}), "
                f"{len(val_src):,} val tokens")
        return RunData(it, val, desc, documents=_documents(cfg, tokenizer))
    # A mixture: train windows by weight; validation takes batches from every source, in
    # proportion to its weight and at least one each, so val_loss covers the whole mixture.
    paths, weights = [s.path for s in cfg.data.sources], [s.weight for s in cfg.data.sources]
    trains = [SequenceDataset(_open(p, tokenizer, cfg, "train"), t.seq_len) for p in paths]
    it = MixtureBatchIterator(trains, weights, batch, seed=t.seed, rank=dp_rank, world_size=dp_size)
    val = []
    for p, share in zip(paths, it.weights):
        n = max(1, round(share * t.eval_batches))
        val += eval_batches(SequenceDataset(_open(p, tokenizer, cfg, "val"), t.seq_len), t.micro_batch_size, n)
    parts = ", ".join(f"{p} x{share:.2f} ({len(d):,} windows)" for p, share, d in zip(paths, it.weights, trains))
    return RunData(it, val, f"mixture of {len(paths)}: {parts}; {len(val)} val batches",
                   documents=_documents(cfg, tokenizer))
