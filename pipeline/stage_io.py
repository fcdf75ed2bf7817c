"""The typed object that travels between pipeline chunks."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StageIO:
    """What one model chunk hands to the next.

    hidden: ``[B, T, D]`` residual stream (standard residual) or the partial sum ``b_n^i`` of
        the AttnRes block that is still open; ``None`` when a block closed exactly at the
        chunk end (the next chunk then starts a fresh partial sum).
    blocks: global AttnRes block index -> ``[B, T, D]`` completed block; block 0 is the
        embedding. Contains every block available after the chunk that produced this object.
        Empty for the standard residual.
    segments: the microbatch's document boundaries (``cu_seqlens`` ``[N+1]`` over the ``B*T``
        tokens flattened row by row), or None for one sequence per row. Metadata, not an
        activation: it never travels between ranks; every rank's engine attaches its own copy
        from the microbatch (its third element, ``PipelineEngine.train_step``). Under context
        parallelism they are the whole windows' boundaries while ``hidden`` and ``blocks`` hold
        this rank's slice of each row (the mixers map them, ``k3train.model.cp_documents``).
    """

    hidden: torch.Tensor | None
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)
    segments: torch.Tensor | None = None
