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


def _attempt_store(timeout: timedelta) -> dist.Store:
    """torchrun's rendezvous store, seen through a prefix of its own for each restart attempt.

    ``torchrun --max-restarts`` keeps one TCP store server for all attempts (its agent shares
    it with the workers, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset), and torch's ``env://``
    rendezvous adds no per-attempt prefix. A restarted worker group then reads the addresses
    the dead attempt's ranks published for gloo's full mesh and for every later group, and
    fails in ``connectFullMesh ... Connection refused`` or hangs creating megatron-core's
    groups. Keys under ``attempt_<TORCHELASTIC_RESTART_COUNT>/`` are fresh in each attempt.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def check_layout(world_size: int, tp: int, pp: int, ep: int) -> int:
    """Return the data-parallel size or raise naming the impossible layout."""
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tp*parallel.pp = {tp}*{pp}; "
            f"launch a multiple of {tp * pp} processes or change tp/pp"
        )
    dp = world_size // (tp * pp)
    if (dp * tp) % ep:
        raise ValueError(
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
            timeout = timedelta(minutes=30)
            dist.init_process_group(backend, store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = check_layout(world, tp, pp, ep)
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
