"""Build the run's token streams from the config: train batches and fixed validation batches."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from k3train.errors import DataError
from k3train.config import RunConfig
from k3train.data import BatchIterator, SequenceDataset, TokenSource, eval_batches, get_tokenizer
from k3train.data.mqar import MQARBatchIterator, check_mqar_fits, mqar_targets, mqar_val_batches


def next_token_targets(windows: torch.Tensor) -> torch.Tensor:
    """windows [B, T + 1] -> targets [B, T]: every next token is a target."""
    return windows[:, 1:]


@dataclass
class RunData:
    train: BatchIterator | MQARBatchIterator
    """next() -> LongTensor [micro_batch_size * microbatches, seq_len + 1] for this DP rank."""
    val: list[torch.Tensor]
    """Fixed validation batches, each [micro_batch_size, seq_len + 1]."""
    description: str
    targets: Callable[[torch.Tensor], torch.Tensor] = field(default=next_token_targets)
    """windows [B, T + 1] -> targets [B, T] for the loss (inputs are always ``windows[:, :-1]``);
    masked positions hold -100, which ``F.cross_entropy`` ignores. Text data: ``windows[:, 1:]``."""


def _build_mqar(cfg: RunConfig, dp_rank: int, dp_size: int) -> RunData:
    t, mq = cfg.train, cfg.data.mqar
    check_mqar_fits(mq, t.seq_len, cfg.model.vocab_size)
    it = MQARBatchIterator(mq, t.seq_len, t.micro_batch_size * t.microbatches, seed=t.seed,
                           rank=dp_rank, world_size=dp_size)
    val = mqar_val_batches(mq, t.seq_len, t.micro_batch_size, t.eval_batches)
    desc = (f"MQAR: {mq.num_pairs} pairs, {mq.queries} queries per window of {t.seq_len + 1}, "
            f"keys {list(mq.key_range)}, values {list(mq.value_range)}, val seed {mq.val_seed}")
    return RunData(it, val, desc, targets=partial(mqar_targets, cfg=mq))


def build_data(cfg: RunConfig, dp_rank: int = 0, dp_size: int = 1) -> RunData:
    if cfg.data.source == "mqar":
        return _build_mqar(cfg, dp_rank, dp_size)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise DataError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the '{tokenizer.name}' tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}); set model.vocab_size >= {tokenizer.vocab_size}")
    t = cfg.train
    if cfg.data.source == "embedded":
        train_src = TokenSource.embedded(tokenizer, "train", cfg.data.val_fraction)
        val_src = TokenSource.embedded(tokenizer, "val", cfg.data.val_fraction)
    else:
        train_src = TokenSource.from_prefix(cfg.data.source, tokenizer, "train", cfg.data.val_fraction)
        val_src = TokenSource.from_prefix(cfg.data.source, tokenizer, "val", cfg.data.val_fraction)
    train_ds, val_ds = SequenceDataset(train_src, t.seq_len), SequenceDataset(val_src, t.seq_len)
    it = BatchIterator(train_ds, t.micro_batch_size * t.microbatches, seed=t.seed, rank=dp_rank,
                       world_size=dp_size)
    val = eval_batches(val_ds, t.micro_batch_size, t.eval_batches)
    desc = (f"{train_src!r}: {len(train_src):,} train tokens ({len(train_ds):,} windows of {t.seq_len}), "
            f"{len(val_src):,} val tokens")
    return RunData(it, val, desc)
