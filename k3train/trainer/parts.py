"""Which part of the model a rank holds: the whole model (pp=1) or its pipeline chunks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from megatron.core import parallel_state

from k3train.config import RunConfig
from k3train.model.model import K3Chunk, build_model, produced_blocks
from pipeline import CommRecorder, PipelineEngine, PipelineLayout


class LocalChunks(nn.ModuleDict):
    """This rank's chunks keyed by global chunk index (as strings, ModuleDict keys)."""

    def moe_layers(self) -> list[nn.Module]:
        return [m for chunk in self.values() for m in chunk.moe_layers()]

    def moe_layer_indices(self) -> list[int]:
        """Global layer index of each entry of ``moe_layers()``."""
        return [i for chunk in self.values() for i in chunk.moe_layer_indices()]


def _directional_pp_groups(backend: str, p2p_backend: str = "auto"):
    """The (up, down) groups the pipeline's messages travel on, or None for the pipeline group.

    NCCL runs sends and receives of one group on one stream, so opposite directions can wait
    on each other; the engine takes two copies of the pipeline group (up, down).
    ``p2p_backend="gloo"`` on NCCL gives one gloo copy for both directions (gloo matches by tag;
    the engine then stages GPU tensors through host memory). Every rank must create every group
    in the same order, so all pipeline groups are gathered first."""
    gloo = p2p_backend == "gloo"  # its own groups on a gloo world too (what the CPU tests run)
    if backend != "nccl" and not gloo:
        return None
    mine = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
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


def build_parts(cfg: RunConfig, device: torch.device, recorder: CommRecorder | None = None):
    """Returns (module holding this rank's parameters, engine or None)."""
    p = cfg.parallel
    if p.pp == 1 and p.vpp == 1:
        return build_model(cfg).to(device), None
    layout = PipelineLayout(cfg.model.num_layers, p.pp, p.vpp)
    ranges = [(r.start, r.stop) for r in map(layout.layer_range, range(layout.num_chunks))]
    rank = parallel_state.get_pipeline_model_parallel_rank()
    last = layout.num_chunks - 1
    chunks = LocalChunks({str(c): K3Chunk(cfg, *ranges[c], first=c == 0, last=c == last)
                          for c in layout.chunks_of_rank(rank)}).to(device)
    # dp_group stays None: the trainer reduces gradients itself (expert weights need their own group).
    engine = PipelineEngine(
        {int(c): m for c, m in chunks.items()}, layout.num_chunks, produced_blocks(cfg, ranges),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        transport=cfg.pipeline.attnres_transport,
        recorder=recorder,
        directional_groups=_directional_pp_groups(dist.get_backend(), cfg.pipeline.p2p_backend),
    )
    return chunks, engine
