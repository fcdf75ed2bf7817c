"""Weighted mixtures of datasets (``data.sources``): deterministic, DP-sharded, exactly resumable.

Step ``s`` fills one global batch of ``G = batch_size * world_size`` slots. Slot ``j`` draws its
source from ``default_rng([seed, s]).choice(K, G, p=weights)``, so the draw depends only on the
seed and the step (every rank computes the same one, and a resumed run needs no RNG state).
Each source walks its own window permutation (``default_rng([seed, k, epoch])``, a fresh one per
epoch); the slots that chose source ``k`` take its next windows in slot order, and a source
whose epoch runs out continues with the next one. Rank ``r`` returns slots
``[r*batch_size, (r+1)*batch_size)``, so ranks are disjoint and their union is the
world_size=1 batch.

The state is the step plus each source's (epoch, position): every rank advances every source
by the global counts, so any rank's state resumes all of them.
"""
from __future__ import annotations

import numpy as np
import torch

from k3train.data.dataset import SequenceDataset
from k3train.errors import DataError

__all__ = ["MixtureBatchIterator"]


class _Cursor:
    """Position in one source's sequence of epoch permutations."""

    def __init__(self, n: int, seed: int, k: int) -> None:
        self.n, self.seed, self.k = n, seed, k
        self.epoch = self.position = 0
        self._perm: tuple[int, np.ndarray] | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None or self._perm[0] != self.epoch:
            self._perm = (self.epoch, np.random.default_rng([self.seed, self.k, self.epoch]).permutation(self.n))
        return self._perm[1]

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` window indices [count], crossing into later epochs as needed."""
        out = []
        while count > 0:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
            got = self._permutation()[self.position:self.position + count]
            out.append(got)
            self.position += len(got)
            count -= len(got)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class MixtureBatchIterator:
    """Infinite batches drawn from several ``SequenceDataset``s by weight (see module docstring).

    ``datasets``: K datasets with one ``seq_len``; ``weights``: K positive numbers (normalised
    here). ``next(it)`` -> LongTensor [batch_size, seq_len + 1].
    """

    def __init__(self, datasets: list[SequenceDataset], weights: list[float], batch_size: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if not datasets or len(datasets) != len(weights):
            raise DataError(f"need one weight per dataset, got {len(datasets)} datasets, {len(weights)} weights")
        if any(w <= 0 for w in weights):
            raise DataError(f"data.sources weights must be > 0, got {list(weights)}")
        if len({d.seq_len for d in datasets}) != 1:
            raise DataError("every dataset of a mixture must use one seq_len")
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"need batch_size >= 1 and 0 <= rank < world_size, got batch_size={batch_size}, "
                            f"rank={rank}, world_size={world_size}")
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.datasets, self.batch_size = datasets, batch_size
        self.rank, self.world_size, self.global_batch = rank, world_size, batch_size * world_size
        self.seed, self.step = int(seed), 0
        self._cursors = [_Cursor(len(d), self.seed, k) for k, d in enumerate(datasets)]

    def __iter__(self) -> "MixtureBatchIterator":
        return self

    def slot_sources(self, step: int) -> np.ndarray:
        """Source index of each global-batch slot at ``step`` -> int [global_batch]."""
        rng = np.random.default_rng([self.seed, step])
        return rng.choice(len(self.datasets), size=self.global_batch, p=self.weights)

    def __next__(self) -> torch.Tensor:
        sources = self.slot_sources(self.step)
        windows = np.empty(self.global_batch, dtype=np.int64)
        for k, cursor in enumerate(self._cursors):
            slots = np.flatnonzero(sources == k)
            windows[slots] = cursor.take(len(slots))  # every rank advances every source alike
        self.step += 1
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        rows = [self.datasets[k].batch(windows[j:j + 1]) for j, k in zip(range(lo, hi), sources[lo:hi])]
        return torch.cat(rows)

    def state_dict(self) -> dict:
        """``{"mixture", "step", "seed", "weights", "cursors": [[epoch, position], ...]}``."""
        return {"mixture": True, "step": self.step, "seed": self.seed, "weights": self.weights.tolist(),
                "cursors": [[c.epoch, c.position] for c in self._cursors]}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("mixture"):
            raise DataError("the checkpoint's data position is from a single dataset, but this run reads a "
                            "data.sources mixture; resume with the data settings it was saved with")
        cursors = state["cursors"]
        if len(cursors) != len(self._cursors) or not np.allclose(state["weights"], self.weights):
            raise DataError(f"the checkpoint's mixture has weights {state['weights']}, this run "
                            f"{self.weights.tolist()}; resume with the data.sources it was saved with")
        self.step, self.seed = int(state["step"]), int(state["seed"])
        for c, (epoch, position) in zip(self._cursors, cursors):
            c.seed, c.epoch, c.position, c._perm = self.seed, int(epoch), int(position), None
