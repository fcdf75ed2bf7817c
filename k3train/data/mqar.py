"""Multi-query associative recall (MQAR, as in Zoology / Based): a synthetic recall benchmark.

A window of ``L = seq_len + 1`` tokens (P = ``num_pairs``, Q = ``num_queries``)::

    k_1 v_1 k_2 v_2 ... k_P v_P | f f k_a v_a f f f f k_b v_b f ...   (f = filler)
    \\______ 2P pairs ________/   \\______ query region, L - 2P tokens ______/

Keys are distinct ids drawn from ``key_range``, values are drawn (with repeats) from
``value_range``. The query region is cut into ``(L - 2P) // 2`` two-token slots; Q of them, at
random, hold a queried key followed by the value it was paired with, in random query order,
the rest hold filler. The window is an ordinary token stream (inputs ``w[:-1]``, next-token
targets ``w[1:]``), so any trainer can consume it; ``mqar_targets`` masks every target except
the recalled values with -100 (``F.cross_entropy``'s default ``ignore_index``), so a loss or
accuracy over those targets measures recall only. The mask is a function of the window
alone: a position in the query region whose input is a key is a query.

Every sequence is generated from its own seed ``(seed, split salt, global index)``, so batches
are deterministic, independent of the data-parallel layout, and resume needs only a counter.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from k3train.errors import DataError
from k3train.config.schema import MQARConfig

__all__ = ["MQARBatchIterator", "mqar_sequence", "mqar_batch", "mqar_targets", "mqar_val_batches",
           "recall_accuracy", "check_mqar_fits"]

IGNORE_INDEX = -100
_TRAIN_SALT, _VAL_SALT = 0, 1


def check_mqar_fits(cfg: MQARConfig, seq_len: int, vocab_size: int) -> None:
    """Raise ValueError naming the fields when the task does not fit the window or vocabulary."""
    need = 2 * cfg.num_pairs + 2 * cfg.queries
    if need > seq_len + 1:
        raise DataError(f"data.mqar needs 2*num_pairs + 2*num_queries = {need} tokens per window, "
                         f"more than train.seq_len + 1 = {seq_len + 1}")
    top = max(cfg.key_range[1], cfg.value_range[1], cfg.filler_id + 1)
    if top > vocab_size:
        raise DataError(f"data.mqar token ids reach {top - 1}, outside model.vocab_size={vocab_size}")


def mqar_sequence(cfg: MQARConfig, length: int, rng: np.random.Generator) -> np.ndarray:
    """One window -> int64 [length] (``length = seq_len + 1``)."""
    P, Q = cfg.num_pairs, cfg.queries
    keys = rng.choice(np.arange(*cfg.key_range), size=P, replace=False)
    values = rng.integers(*cfg.value_range, size=P)
    seq = np.full(length, cfg.filler_id, dtype=np.int64)
    seq[0:2 * P:2], seq[1:2 * P:2] = keys, values
    slots = np.sort(rng.choice((length - 2 * P) // 2, size=Q, replace=False))
    asked = rng.choice(P, size=Q, replace=False)  # which pairs are queried, in query order
    starts = 2 * P + 2 * slots
    seq[starts], seq[starts + 1] = keys[asked], values[asked]
    return seq


def _rng(seed: int, salt: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, salt, int(index)]))


def mqar_batch(cfg: MQARConfig, length: int, seed: int, salt: int, indices: Iterable[int]) -> torch.Tensor:
    """Sequences ``indices`` of the stream ``(seed, salt)`` -> LongTensor [len(indices), length]."""
    rows = [mqar_sequence(cfg, length, _rng(seed, salt, i)) for i in indices]
    return torch.from_numpy(np.stack(rows))


def mqar_targets(windows: torch.Tensor, cfg: MQARConfig) -> torch.Tensor:
    """windows [B, L] -> targets [B, L-1]: ``windows[:, 1:]`` at query positions, -100 elsewhere."""
    inputs, nxt = windows[:, :-1], windows[:, 1:]
    lo, hi = cfg.key_range
    in_query_region = torch.arange(inputs.shape[1], device=windows.device) >= 2 * cfg.num_pairs
    is_query = in_query_region & (inputs >= lo) & (inputs < hi)
    return torch.where(is_query, nxt, torch.full_like(nxt, IGNORE_INDEX))


class MQARBatchIterator:
    """Infinite, deterministic, resumable MQAR training batches (the ``BatchIterator`` API).

    Step ``s`` uses the global sequence indices ``[s*G, (s+1)*G)`` with ``G = batch_size *
    world_size``; data-parallel rank ``r`` takes ``[s*G + r*batch_size, s*G + (r+1)*batch_size)``.
    ``next(it)`` -> LongTensor [batch_size, seq_len + 1].
    """

    def __init__(self, cfg: MQARConfig, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size, got "
                             f"batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.cfg, self.length = cfg, seq_len + 1
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.position = int(seed), 0

    def __iter__(self) -> "MQARBatchIterator":
        return self

    def __next__(self) -> torch.Tensor:
        start = self.position + self.rank * self.batch_size
        self.position += self.batch_size * self.world_size
        return mqar_batch(self.cfg, self.length, self.seed, _TRAIN_SALT, range(start, start + self.batch_size))

    def state_dict(self) -> dict:
        """``{"position", "seed"}``; ``position`` counts global sequences (rank-independent)."""
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        missing = {"position", "seed"} - set(state)
        if missing:
            raise ValueError(f"MQARBatchIterator state is missing {sorted(missing)}")
        self.position, self.seed = int(state["position"]), int(state["seed"])


def mqar_val_batches(cfg: MQARConfig, seq_len: int, batch_size: int, num_batches: int) -> list[torch.Tensor]:
    """Fixed validation batches, each LongTensor [batch_size, seq_len + 1], from ``cfg.val_seed``."""
    return [mqar_batch(cfg, seq_len + 1, cfg.val_seed, _VAL_SALT,
                       range(b * batch_size, (b + 1) * batch_size)) for b in range(num_batches)]


@torch.no_grad()
def recall_accuracy(model: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor],
                    cfg: MQARConfig, device: torch.device | str = "cpu") -> float:
    """Fraction of queried values predicted exactly (argmax) by ``model``.

    ``model(inputs [B, T]) -> logits [B, T, vocab]`` (the K3 model without targets); ``batches``
    are MQAR windows [B, T + 1]. Every query counts once, whichever batch it is in.
    """
    if isinstance(model, torch.nn.Module):
        model.eval()
    correct, total = 0, 0
    for b in batches:
        b = b.to(device)
        targets = mqar_targets(b, cfg)
        mask = targets != IGNORE_INDEX
        pred = model(b[:, :-1]).argmax(-1)
        correct += int((pred[mask] == targets[mask]).sum())
        total += int(mask.sum())
    if total == 0:
        raise ValueError("the batches hold no MQAR queries")
    return correct / total
