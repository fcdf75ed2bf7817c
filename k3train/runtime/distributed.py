"""Process groups: torch.distributed (gloo on CPU, NCCL on CUDA) plus megatron-core's groups.

A run without ``torchrun`` still initialises a one-process group so that the same code runs
unchanged on a laptop. A one-process world makes its size-1 groups here (``_SoloGroups``)
without megatron-core: importing it costs seconds (it pulls in Dynamo, Inductor and wandb) that
a one-GPU run would pay before its first step. Several processes take megatron-core's groups
(``parallel_state``, imported then): its rank order (tp-cp-ep-dp-pp) is the run's layout, and
its tensor-parallel linears (``parallel.tp > 1``) ask it for their group.

This module is the one place that makes process groups: ``init_distributed`` (the world and
megatron-core's groups) and ``parallel_context`` (this rank's groups and ranks in one frozen
object, including the pipeline's message groups). The trainer, the model parts and the
pipeline engine receive groups from it instead of creating or fetching their own.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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
    cp: int = 1

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


def check_layout(world_size: int, tp: int, pp: int, ep: int, vpp: int = 1, cp: int = 1) -> int:
    """Return the data-parallel size or raise ``LayoutError`` naming the impossible layout.

    Checked here, before megatron-core builds its groups: its own refusals are bare
    RuntimeErrors or assertions that name neither our config keys nor a fix. Only the rules that
    need the world size; the rest of the layout (vpp/pp, EP x TP, ...) is refused when the config
    loads (``k3train.config.layout_rules.layout_refusal``)."""
    if world_size % (tp * pp * cp):
        what, names = (f"{tp}*{pp}", "tp/pp") if cp == 1 else (f"{tp}*{pp}*{cp}", "tp/pp/cp")
        raise LayoutError(
            f"world size {world_size} is not divisible by parallel.tp*parallel.pp"
            f"{'' if cp == 1 else '*parallel.cp'} = {what}; "
            f"launch a multiple of {tp * pp * cp} processes or change {names}"
        )
    dp = world_size // (tp * pp * cp)
    # megatron-core lays the expert groups over the ranks of one pipeline stage whatever CP
    # does, so under CP the expert-parallel group may span the CP ranks of a replica and DP.
    if (dp * tp * cp) % ep:
        size = "data-parallel x tensor-parallel" if cp == 1 else "data- x tensor- x context-parallel"
        raise LayoutError(
            f"parallel.ep={ep} must divide {size} size {dp * tp * cp} "
            f"(world {world_size} / pp {pp})"
        )
    return dp


@dataclass(frozen=True)
class _SoloGroups:
    """The groups of a one-process world, each of size 1 (one ``new_group([0])`` per role, as
    megatron-core makes them): tensor, pipeline, data, expert, expert-data, context."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    edp: dist.ProcessGroup
    cp: dist.ProcessGroup


# The one-process groups in force (None under several processes, or before init_distributed):
# process-wide, as torch.distributed's world and megatron-core's parallel_state are.
_solo: _SoloGroups | None = None


def _megatron_state():
    """megatron-core's ``parallel_state``, imported on first use (several processes, or tp > 1)."""
    from megatron.core import parallel_state

    return parallel_state


def _megatron_groups_made() -> bool:
    """Whether megatron-core's groups exist, without importing megatron-core to ask."""
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps is not None and ps.model_parallel_is_initialized()


def groups_initialized() -> bool:
    """Whether ``init_distributed`` (or a harness that made megatron-core's groups) has run."""
    return _solo is not None or _megatron_groups_made()


def _drop_groups() -> None:
    global _solo
    _solo = None
    if _megatron_groups_made():
        _megatron_state().destroy_model_parallel()


def init_distributed(tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, device: str = "cpu",
                     cp: int = 1) -> ParallelInfo:
    """Initialise torch.distributed (if needed) and the model-parallel groups: size-1 groups of
    our own in a one-process world, megatron-core's otherwise.
    cp: context-parallel size (megatron-core's order tp-cp-ep-dp-pp: the cp ranks of one
    data-parallel replica are consecutive after tp); ``ParallelInfo.dp`` excludes it."""
    global _solo
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
    dp = check_layout(world, tp, pp, ep, vpp, cp)
    _drop_groups()
    if world == 1:  # check_layout leaves tp = pp = ep = cp = 1 (vpp needs no group)
        _solo = _SoloGroups(*(dist.new_group([0]) for _ in range(6)))
    else:
        _megatron_state().initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            expert_model_parallel_size=ep,
            context_parallel_size=cp,
        )
    return ParallelInfo(world, rank, int(os.environ.get("LOCAL_RANK", "0")), tp, pp, vpp, ep, dp, cp)


def tensor_parallel_size() -> int:
    """This rank's tensor-parallel group size (1 in a one-process world)."""
    return 1 if _solo is not None else _megatron_state().get_tensor_model_parallel_world_size()


def tensor_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group (0 in a one-process world)."""
    return 0 if _solo is not None else _megatron_state().get_tensor_model_parallel_rank()


def tensor_parallel_group() -> dist.ProcessGroup:
    """This rank's tensor-parallel group."""
    return _solo.tp if _solo is not None else _megatron_state().get_tensor_model_parallel_group()


def _pipeline_group() -> dist.ProcessGroup:
    return _solo.pp if _solo is not None else _megatron_state().get_pipeline_model_parallel_group()


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the run: sizes, ranks and process groups, made by ``parallel_context``.

    info: sizes (world, tp, pp, vpp, ep, dp) and this process's global and local rank.
    tp_rank, pp_rank, ep_rank, dp_rank, cp_rank: this rank's index in each dimension
        (``dp_rank`` without CP: the CP ranks of one replica read the same data).
    tp_group, pp_group, dp_group, ep_group, edp_group, cp_group: megatron-core's tensor-,
        pipeline-, data-, expert-, expert-data- and context-parallel groups (each exists, of
        size 1 where unused; ``dp_group`` without CP, ``edp_group`` spans CP as megatron's does).
    dp_cp_group: the data x context-parallel group weight gradients and the loss are averaged
        over (``dp_group`` itself at cp=1).
    pp_messages: ``(up, down)`` groups the pipeline's messages travel on, or None to use
        ``pp_group`` (see ``pipeline_message_groups``); None too without a pipeline engine.
    """

    info: ParallelInfo
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup
    pp_messages: tuple | None
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    dp_cp_group: dist.ProcessGroup | None = None


def pipeline_message_groups(p2p_backend: str = "auto") -> tuple | None:
    """The (up, down) groups the pipeline's messages travel on, or None for the pipeline group.

    NCCL runs sends and receives of one group on one stream, so opposite directions can wait
    on each other; the engine takes two copies of the pipeline group (up, down).
    ``p2p_backend="gloo"`` on NCCL gives one gloo copy for both directions (gloo matches by tag;
    the engine then stages GPU tensors through host memory). Every rank must create every group
    in the same order, so all pipeline groups are gathered first. Collective over the world."""
    gloo = p2p_backend == "gloo"  # its own groups on a gloo world too (what the CPU tests run)
    if dist.get_backend() != "nccl" and not gloo:
        return None
    mine = dist.get_process_group_ranks(_pipeline_group())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result = None
    for ranks in sorted({tuple(r) for r in everyone}):
        if gloo:
            up = down = dist.new_group(list(ranks), backend="gloo")
        else:
            up, down = dist.new_group(list(ranks)), dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            result = (up, down)
    return result


def parallel_context(info: ParallelInfo, *, p2p_backend: str = "auto") -> ParallelContext:
    """This rank's groups and ranks after ``init_distributed`` (collective over the world when
    the run has a pipeline engine, i.e. pp > 1 or vpp > 1: its message groups are made here).
    p2p_backend: ``pipeline.p2p_backend`` ("auto" or "gloo")."""
    engine = info.pp > 1 or info.vpp > 1
    messages = pipeline_message_groups(p2p_backend) if engine else None
    if _solo is not None:
        g = _solo
        return ParallelContext(info=info, tp_rank=0, pp_rank=0, ep_rank=0, dp_rank=0, tp_group=g.tp,
                               pp_group=g.pp, dp_group=g.dp, ep_group=g.ep, edp_group=g.edp,
                               pp_messages=messages, cp_rank=0, cp_group=g.cp, dp_cp_group=g.dp)
    ps = _megatron_state()
    return ParallelContext(
        info=info,
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(), ep_group=ps.get_expert_model_parallel_group(),
        edp_group=ps.get_expert_data_parallel_group(),
        pp_messages=messages,
        cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group(),
        dp_cp_group=(ps.get_data_parallel_group(with_context_parallel=True) if info.cp > 1
                     else ps.get_data_parallel_group()),
    )


def expert_group_in_force(ep: int) -> dist.ProcessGroup | None:
    """The expert-parallel group for a builder that holds no run context: the run's where its
    groups exist (size 1 at ep=1), and None (the world group) where they do not, as in a
    meta-device model-info. Never None in a multi-process run: the world group would split the
    experts over the data-parallel ranks of an ep=1 run. ``ep > 1`` requires the groups."""
    if _solo is not None:
        return _solo.ep
    if ep > 1 or _megatron_groups_made():
        return _megatron_state().get_expert_model_parallel_group()
    return None


def shutdown_distributed() -> None:
    _drop_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
