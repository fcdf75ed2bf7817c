"""Which part of the model a rank holds: the whole model (pp=1) or its pipeline chunks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from k3train.config import RunConfig
from k3train.errors import LayoutError
from k3train.ops.context_parallel import CPCommLog
from k3train.runtime.distributed import ParallelContext
from k3train.model.model import K3Chunk, build_model, produced_blocks
from pipeline import CommRecorder, PipelineEngine, PipelineLayout


class LocalChunks(nn.ModuleDict):
    """This rank's chunks keyed by global chunk index (as strings, ModuleDict keys)."""

    def moe_layers(self) -> list[nn.Module]:
        return [m for chunk in self.values() for m in chunk.moe_layers()]

    def moe_layer_indices(self) -> list[int]:
        """Global layer index of each entry of ``moe_layers()``."""
        return [i for chunk in self.values() for i in chunk.moe_layer_indices()]

    def use_context_parallel(self, group, log: CPCommLog, partition: str = "contiguous") -> None:
        """Every chunk's mixers exchange over the context-parallel ``group`` on the rank's
        ``partition`` pieces (``K3Chunk.use_context_parallel``), all logging into the one ``log``."""
        self.cp_log = log
        for chunk in self.values():
            chunk.use_context_parallel(group, log, partition)


def build_parts(cfg: RunConfig, device: torch.device, parallel: ParallelContext,
                recorder: CommRecorder | None = None):
    """Returns (module holding this rank's parameters, engine or None); the engine gets its
    groups from ``parallel`` (k3train.runtime.distributed makes them). Under
    ``parallel.cp > 1`` the model's mixers exchange over ``parallel.cp_group``."""
    if cfg.parallel.pp == 1 and cfg.parallel.vpp == 1:
        model = build_model(cfg, ep_group=parallel.ep_group).to(device)
        if parallel.info.cp > 1:
            # The bytes the exchanges send, for the cp/bytes_sent metric (TrainState.cp_metrics).
            model.use_context_parallel(parallel.cp_group, CPCommLog(), cfg.parallel.cp_partition)
        return model, None
    return build_pipeline_parts(cfg, device, parallel, recorder)


def build_pipeline_parts(cfg: RunConfig, device: torch.device, parallel: ParallelContext,
                         recorder: CommRecorder | None = None):
    """This rank's ``pp * vpp`` layout chunks and the engine driving them, at any size
    (pp = vpp = 1 too: one chunk under the engine, as the engine-overhead benchmark runs it).

    Under ``parallel.cp > 1`` every chunk holds this CP rank's slice of each window (``seq_len /
    cp`` tokens): its mixers exchange over ``parallel.cp_group`` within the stage, and its hops
    go to the same CP rank of the neighbouring stages, as megatron-core's pipeline groups pair
    them (``_check_cp_pairing``). The p2p shapes follow from the first message (``seq_len /
    cp``), and the AttnRes block cache holds this rank's tokens only: nothing else changes."""
    p = cfg.parallel
    layout = PipelineLayout(cfg.model.num_layers, p.pp, p.vpp)
    ranges = [(r.start, r.stop) for r in map(layout.layer_range, range(layout.num_chunks))]
    rank = parallel.pp_rank
    last = layout.num_chunks - 1
    chunks = LocalChunks({str(c): K3Chunk(cfg, *ranges[c], first=c == 0, last=c == last, ep_group=parallel.ep_group)
                          for c in layout.chunks_of_rank(rank)}).to(device)
    # dp_group stays None: the trainer reduces gradients itself (expert weights need their own group).
    engine = PipelineEngine(
        local_chunks={int(c): m for c, m in chunks.items()}, num_chunks=layout.num_chunks,
        produced_blocks=produced_blocks(cfg, ranges),
        # P = 1 needs no group: every hop is a local hand-over, and the loss needs no broadcast.
        pp_group=parallel.pp_group if p.pp > 1 else None,
        transport=cfg.pipeline.attnres_transport,
        recorder=recorder,
        directional_groups=parallel.pp_messages,
    )
    if parallel.info.cp > 1:
        if p.pp > 1:
            _check_cp_pairing(parallel)
        chunks.use_context_parallel(parallel.cp_group, CPCommLog(), cfg.parallel.cp_partition)
    return chunks, engine


def _check_cp_pairing(parallel: ParallelContext) -> None:
    """Raise unless every rank of this rank's pipeline group has this rank's CP rank: a hop
    carries one CP rank's tokens, so a stage must hand them to the same slice's owner.
    megatron-core's groups pair them (its order tp-cp-ep-dp-pp: a pipeline group varies pp
    only); this guards that assumption once, at build time (one small gather)."""
    ranks: list = [None] * dist.get_world_size(parallel.pp_group)
    dist.all_gather_object(ranks, parallel.cp_rank, group=parallel.pp_group)
    if len(set(ranks)) != 1:
        raise LayoutError(f"the pipeline group of rank {dist.get_rank()} pairs context-parallel ranks "
                          f"{ranks}; each pipeline hop must stay within one CP rank (parallel.cp)")
