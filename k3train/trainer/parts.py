"""Which part of the model a rank holds: the whole model (pp=1) or its pipeline chunks."""
from __future__ import annotations

import torch
import torch.nn as nn

from k3train.config import RunConfig
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


def build_parts(cfg: RunConfig, device: torch.device, parallel: ParallelContext,
                recorder: CommRecorder | None = None):
    """Returns (module holding this rank's parameters, engine or None); the engine gets its
    groups from ``parallel`` (k3train.runtime.distributed makes them). Under
    ``parallel.cp > 1`` the model's mixers exchange over ``parallel.cp_group``."""
    if cfg.parallel.pp == 1 and cfg.parallel.vpp == 1:
        model = build_model(cfg, ep_group=parallel.ep_group).to(device)
        if parallel.info.cp > 1:  # the config allows cp > 1 at pp = 1 only, for now
            # The bytes the exchanges send, for the cp/bytes_sent metric (TrainState.cp_metrics).
            model.use_context_parallel(parallel.cp_group, CPCommLog())
        return model, None
    return build_pipeline_parts(cfg, device, parallel, recorder)


def build_pipeline_parts(cfg: RunConfig, device: torch.device, parallel: ParallelContext,
                         recorder: CommRecorder | None = None):
    """This rank's ``pp * vpp`` layout chunks and the engine driving them, at any size
    (pp = vpp = 1 too: one chunk under the engine, as the engine-overhead benchmark runs it)."""
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
    return chunks, engine
