"""The run's expert-load statistics: what the ``moe/*`` metrics and ``expert_load.png`` show.

Each step, every MoE layer's routing record (``moe.RoutingRecord``) gives the step's load per
expert and the slots its dispatcher dropped; they are summed over the data-parallel ranks
(which saw different tokens) and recorded in one ``LoadTracker`` row per MoE layer of the
*whole* model, so the row of a layer is the same whichever pipeline stage holds it. The
metrics and the load matrix are gathered over the pipeline stages, so the main rank reports
every layer, not only its own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe import LoadTracker


class MoEStats:
    """Load statistics of this rank's MoE layers (module docstring).

    Args:
        layers: this rank's MoE layers (``LatentMoE``), in model order.
        rows: for each layer, its index among all MoE layers of the model (tracker row).
        num_moe_layers: MoE layers in the whole model.
        num_experts: experts per layer.
        dp_group, dp: data-parallel group and size (loads are summed over it).
        pp_group: pipeline group (None without pipeline parallelism); metrics gather over it.
        device: where the counts live (the exchange device on NCCL).
    """

    def __init__(self, *, layers: list, rows: list[int], num_moe_layers: int, num_experts: int,
                 dp_group, dp: int, pp_group, device: torch.device):
        if len(layers) != len(rows):
            raise ValueError(f"{len(layers)} MoE layers but {len(rows)} tracker rows")
        self.layers, self.rows, self.num_experts = layers, rows, num_experts
        self.dp_group, self.dp, self.pp_group, self.device = dp_group, dp, pp_group, device
        self.tracker = LoadTracker(num_moe_layers, num_experts)

    @torch.no_grad()
    def record_step(self) -> None:
        """Record the step's load and dropped slots of every local layer, summed over DP (one
        collective for all layers). Call after the step's forwards, before ``end_step``."""
        if not self.layers:
            return
        per_layer = [torch.cat([layer.routing.step_load(self.num_experts).double(),
                                layer.routing.step_dropped_tokens(self.device).double().reshape(1)])
                     for layer in self.layers]
        counts = torch.stack(per_layer)                         # [layers, E + 1]
        if self.dp > 1:
            dist.all_reduce(counts, group=self.dp_group)
        for row, c in zip(self.rows, counts):
            self.tracker.record(row, c[:-1], c[-1])

    def end_step(self) -> None:
        """Close the step: clear the layers' routing records, and make the step the one the
        next ``metrics()`` reports (so ``moe/maxvio`` is a per-step figure)."""
        for layer in self.layers:
            layer.routing.clear()
        self.tracker.end_step()

    def _whole_model(self) -> LoadTracker:
        if self.pp_group is None:
            return self.tracker
        return self.tracker.gathered(self.pp_group, self.device)

    def metrics(self) -> dict[str, float]:
        """The last step's ``moe/*`` metrics over every MoE layer of the model. Collective
        over the pipeline group: every rank calls it."""
        return self._whole_model().summary()

    def load_matrix(self) -> torch.Tensor:
        """``[MoE layers, E]`` cumulative loads of the whole model (collective, as ``metrics``)."""
        return self._whole_model().load_matrix()

    def state_dict(self) -> dict:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state, self.device)
