"""The run context: what one command resolved once about where and how it runs, frozen.

A command builds it once (after ``init_distributed`` and the kernel registry's ``apply``) and
passes it down, instead of each part asking megatron-core's ``parallel_state``, the device
resolver or the kernel registry again: the model and its MoE dispatcher take
``parallel.ep_group``, data takes ``parallel.dp_rank`` and ``info.dp``, statistics and the
gradient groups take the ``parallel`` groups. ``parallel_state`` stays for megatron-core's own
layers, which read it themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3train.ops.kernels import KernelChoices
from k3train.runtime.distributed import ParallelContext, ParallelInfo


@dataclass(frozen=True)
class RunContext:
    """parallel: this rank's sizes, ranks and process groups (``ParallelInfo`` in ``.info``);
    device: the device this rank computes on (``cuda:<local rank>`` or ``cpu``);
    kernels: the kernel choices resolved from the run's ``kernels:`` section and the
    environment overrides (delivered to ``k3train.ops``, ``moe`` and ``optim`` once)."""

    parallel: ParallelContext
    device: torch.device
    kernels: KernelChoices

    @property
    def info(self) -> ParallelInfo:
        """World and dimension sizes and this process's ranks."""
        return self.parallel.info
