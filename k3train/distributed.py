"""Process groups: torch.distributed (gloo on CPU, NCCL on CUDA) plus megatron-core's groups.

A run without ``torchrun`` still initialises a one-process group so that the same code (and
megatron-core's tensor-parallel layers, which ask ``parallel_state`` for their group) runs
unchanged on a laptop.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from k3train.errors import LayoutError


@dataclass(frozen=True)
class ParallelInfo:
    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    vpp: int
    ep: int
    dp: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_layout(world_size: int, tp: int, pp: int, ep: int, vpp: int = 1) -> int:
    """Return the data-parallel size or raise ``LayoutError`` naming the impossible layout.

    Checked here, before megatron-core builds its groups: its own refusals are bare
    RuntimeErrors or assertions that name neither our config keys nor a fix."""
    if vpp > 1 and pp == 1:
        raise LayoutError(f"parallel.vpp={vpp} needs parallel.pp > 1 (virtual stages interleave over "
                          f"pipeline ranks); set parallel.vpp=1 or parallel.pp >= 2")
    if ep > 1 and tp > 1:
        raise LayoutError(f"parallel.ep={ep} together with parallel.tp={tp} is not supported yet (experts "
                          f"would need expert-tensor-parallel groups); use parallel.tp=1 with ep, or ep=1")
    if world_size % (tp * pp):
        raise LayoutError(
            f"world size {world_size} is not divisible by parallel.tp*parallel.pp = {tp}*{pp}; "
            f"launch a multiple of {tp * pp} processes or change tp/pp"
        )
    dp = world_size // (tp * pp)
    if (dp * tp) % ep:
        raise LayoutError(
            f"parallel.ep={ep} must divide data-parallel x tensor-parallel size {dp * tp} "
            f"(world {world_size} / pp {pp})"
        )
    return dp


def init_distributed(tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, device: str = "cpu") -> ParallelInfo:
    """Initialise torch.distributed (if needed) and megatron-core's model-parallel groups."""
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if _launched_by_torchrun():
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timedelta(minutes=30))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = check_layout(world, tp, pp, ep, vpp)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=ep,
    )
    return ParallelInfo(world, rank, int(os.environ.get("LOCAL_RANK", "0")), tp, pp, vpp, ep, dp)


def shutdown_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
