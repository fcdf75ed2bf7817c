"""Expert-load metrics: per-expert counts, MaxVio, and a per-layer tracker for logging."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def expert_load(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """indices: ``[N, k]`` (any shape) expert ids -> ``[E]`` int64 counts.

    A scatter-add of ones, not ``bincount``: CUDA bincount reads the max id on the host, a
    device sync once per MoE layer per step."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def max_vio(load: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """MaxVio = max_e load_e / mean_e load_e - 1 for ``load [E]``: 0 when perfectly balanced.

    Returns a 0-dim fp32 tensor (no host sync); 0 for an all-zero load.
    """
    load = torch.as_tensor(load).float()
    mean = load.mean()
    return torch.where(mean > 0, load.max() / mean.clamp_min(1e-30) - 1, torch.zeros_like(mean))


class LoadTracker:
    """Per-layer expert loads for logging, one training step at a time.

    ``record(layer, load, dropped_tokens)`` adds one routing result to the step in progress
    (loads of the same step are summed, so it may be called once per micro-batch);
    ``end_step()`` closes the step. ``summary()`` reports the last closed step (closing the one
    in progress first, if it has records) and the cumulative load since construction (the
    running MaxVio). The trainer ends every step, so a summary written at a logging step
    describes that one step whatever ``train.log_interval`` is. Tensors stay on their device
    until ``summary()``/``load_matrix()``, the only host syncs.

    Layers may live on different ranks (pipeline stages): ``gathered(group)`` sums the
    trackers of ``group``, each holding its own layers, into one that covers them all.
    ``state_dict()``/``load_state_dict()`` checkpoint the cumulative load, so a resumed run
    continues the running statistics.
    """

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self._step_load: list[torch.Tensor | None] = [None] * num_layers
        self._total_load: list[torch.Tensor | None] = [None] * num_layers
        self._last_step_load: list[torch.Tensor | None] = [None] * num_layers
        self._step_dropped: int | torch.Tensor = 0
        self._last_dropped: int | torch.Tensor = 0

    def record(self, layer: int, load: torch.Tensor, dropped_tokens: int | torch.Tensor = 0
               ) -> None:
        """layer: index in ``[0, num_layers)``; load: ``[E]`` counts (already reduced over
        ranks if a global view is wanted); dropped_tokens: slots the dispatcher discarded."""
        load = load.detach().to(torch.float64)
        for store in (self._step_load, self._total_load):
            store[layer] = load.clone() if store[layer] is None else store[layer] + load
        self._step_dropped = self._step_dropped + dropped_tokens

    def end_step(self) -> None:
        """Close the step in progress: it becomes the step ``summary()`` reports (a step with
        no records, e.g. a skipped update, reports no MaxVio and 0 dropped tokens)."""
        self._last_step_load, self._last_dropped = self._step_load, self._step_dropped
        self._step_load, self._step_dropped = [None] * self.num_layers, 0

    def _in_progress(self) -> bool:
        return any(x is not None for x in self._step_load)

    def summary(self) -> dict[str, float]:
        """Metrics of the last closed step (after closing the step in progress, if it has
        records), as plain floats::

            moe/maxvio            mean over layers of this step's MaxVio
            moe/maxvio_max        worst layer this step
            moe/maxvio_running    mean over layers of MaxVio of the cumulative load
            moe/dropped_tokens    slots dropped this step
            moe/maxvio/layer{i}   per-layer MaxVio this step
        """
        if self._in_progress():
            self.end_step()
        out: dict[str, float] = {}
        step = [max_vio(x).item() for x in self._last_step_load if x is not None]
        running = [max_vio(x).item() for x in self._total_load if x is not None]
        for i, x in enumerate(self._last_step_load):
            if x is not None:
                out[f"moe/maxvio/layer{i}"] = max_vio(x).item()
        if step:
            out["moe/maxvio"] = sum(step) / len(step)
            out["moe/maxvio_max"] = max(step)
        if running:
            out["moe/maxvio_running"] = sum(running) / len(running)
        out["moe/dropped_tokens"] = float(self._last_dropped)
        return out

    def load_matrix(self, running: bool = True) -> torch.Tensor:
        """``[num_layers, E]`` fp64 CPU loads for heatmaps: cumulative (``running=True``) or the
        step in progress (falling back to the last closed step); unrecorded layers are 0."""
        rows = self._total_load if running else (
            self._step_load if self._in_progress() else self._last_step_load)
        return _dense(rows, self.num_experts, torch.device("cpu"))

    @torch.no_grad()
    def gathered(self, group: dist.ProcessGroup | None, device: torch.device | None = None
                 ) -> "LoadTracker":
        """Collective over ``group``: one tracker holding every rank's closed steps (the last
        step, the cumulative loads and the last step's dropped slots), summed. Each layer must
        be recorded on one rank of ``group`` only (pipeline stages hold disjoint layers).
        device: where the exchange runs (a CUDA device on NCCL). The step in progress is not
        included. Without a group (or on one rank) returns a copy."""
        device = device if device is not None else torch.device("cpu")
        L, E = self.num_layers, self.num_experts
        parts = [_dense(self._last_step_load, E, device), _dense(self._total_load, E, device),
                 _present(self._last_step_load, device), _present(self._total_load, device),
                 torch.as_tensor(self._last_dropped, dtype=torch.float64, device=device).reshape(1)]
        flat = torch.cat([p.reshape(-1) for p in parts])
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        last, total, last_seen, total_seen, dropped = flat.split([L * E, L * E, L, L, 1])
        out = LoadTracker(L, E)
        out._last_step_load = _sparse(last.view(L, E), last_seen)
        out._total_load = _sparse(total.view(L, E), total_seen)
        out._last_dropped = dropped.item()
        return out

    def state_dict(self) -> dict:
        """The cumulative and last-step loads (CPU tensors) for a checkpoint."""
        cpu = torch.device("cpu")
        return {"num_experts": self.num_experts,
                "total": _dense(self._total_load, self.num_experts, cpu),
                "total_seen": _present(self._total_load, cpu).bool(),
                "last": _dense(self._last_step_load, self.num_experts, cpu),
                "last_seen": _present(self._last_step_load, cpu).bool()}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        """Restore ``state_dict()`` output; the loads go to ``device`` (default CPU)."""
        shape = tuple(state["total"].shape)
        if shape != (self.num_layers, self.num_experts):
            raise ValueError(f"saved expert loads have shape {list(shape)}, this run tracks "
                             f"[{self.num_layers}, {self.num_experts}] (MoE layers, experts)")
        device = device if device is not None else torch.device("cpu")
        self._total_load = _sparse(state["total"].to(device), state["total_seen"].to(device))
        self._last_step_load = _sparse(state["last"].to(device), state["last_seen"].to(device))
        self._step_load, self._step_dropped = [None] * self.num_layers, 0


def _dense(rows: list[torch.Tensor | None], num_experts: int, device: torch.device) -> torch.Tensor:
    """Per-layer ``[E]`` loads (None = unrecorded) -> ``[L, E]`` fp64 on ``device``, zeros for None."""
    mat = torch.zeros(len(rows), num_experts, dtype=torch.float64, device=device)
    for i, x in enumerate(rows):
        if x is not None:
            mat[i] = x.to(device)
    return mat


def _present(rows: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """``[L]`` fp64: 1 where a layer has a load, else 0 (fp64 so it travels with the loads)."""
    return torch.tensor([float(x is not None) for x in rows], dtype=torch.float64, device=device)


def _sparse(mat: torch.Tensor, seen: torch.Tensor) -> list[torch.Tensor | None]:
    """Inverse of ``_dense``/``_present``: ``[L, E]`` and ``[L]`` -> per-layer loads or None."""
    return [row.clone() if flag else None for row, flag in zip(mat, seen.tolist())]
