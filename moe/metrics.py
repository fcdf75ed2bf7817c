"""Expert-load metrics: per-expert counts, MaxVio, and a per-layer tracker for logging."""
from __future__ import annotations

from typing import Sequence

import torch


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
    """Per-layer expert loads for logging.

    ``record(layer, load)`` adds one routing result (call once per micro-batch; loads of the
    same step are summed). ``summary()`` returns the step's metrics and starts a new step;
    cumulative loads since construction give the running MaxVio. Tensors stay on their
    device until ``summary()``/``load_matrix()``, the only host syncs.
    """

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self._step_load: list[torch.Tensor | None] = [None] * num_layers
        self._total_load: list[torch.Tensor | None] = [None] * num_layers
        self._dropped = 0
        self._last_step_load: list[torch.Tensor | None] = [None] * num_layers

    def record(self, layer: int, load: torch.Tensor, dropped_tokens: int | torch.Tensor = 0
               ) -> None:
        """layer: index in ``[0, num_layers)``; load: ``[E]`` counts (already reduced over
        ranks if a global view is wanted); dropped_tokens: tokens the dispatcher discarded."""
        load = load.detach().to(torch.float64)
        for store in (self._step_load, self._total_load):
            store[layer] = load.clone() if store[layer] is None else store[layer] + load
        self._dropped = self._dropped + dropped_tokens

    def summary(self) -> dict[str, float]:
        """Metrics of the step recorded since the last call, as plain floats::

            moe/maxvio            mean over layers of this step's MaxVio
            moe/maxvio_max        worst layer this step
            moe/maxvio_running    mean over layers of MaxVio of the cumulative load
            moe/dropped_tokens    tokens dropped this step
            moe/maxvio/layer{i}   per-layer MaxVio this step
        """
        out: dict[str, float] = {}
        step = [max_vio(x).item() for x in self._step_load if x is not None]
        running = [max_vio(x).item() for x in self._total_load if x is not None]
        for i, x in enumerate(self._step_load):
            if x is not None:
                out[f"moe/maxvio/layer{i}"] = max_vio(x).item()
        if step:
            out["moe/maxvio"] = sum(step) / len(step)
            out["moe/maxvio_max"] = max(step)
        if running:
            out["moe/maxvio_running"] = sum(running) / len(running)
        out["moe/dropped_tokens"] = float(self._dropped)
        self._last_step_load = self._step_load
        self._step_load = [None] * self.num_layers
        self._dropped = 0
        return out

    def load_matrix(self, running: bool = True) -> torch.Tensor:
        """``[num_layers, E]`` fp64 CPU loads for heatmaps: cumulative (``running=True``) or the
        step last summarised (falling back to the step in progress); unrecorded layers are 0."""
        rows = self._total_load if running else (
            self._step_load if any(x is not None for x in self._step_load)
            else self._last_step_load)
        mat = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        for i, x in enumerate(rows):
            if x is not None:
                mat[i] = x.cpu()
        return mat
