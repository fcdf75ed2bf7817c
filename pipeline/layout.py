"""Split L layers into C = P*V model chunks and place chunks on pipeline ranks (loop placement)."""
from __future__ import annotations

from dataclasses import dataclass


def split_layers(num_layers: int, num_chunks: int, first_chunk_layers: int | None = None,
                 last_chunk_layers: int | None = None) -> list[int]:
    """Layer count per chunk, ``len == num_chunks``.

    Even split by default (the remainder goes to the earliest chunks). ``first_chunk_layers`` /
    ``last_chunk_layers`` pin the first and last model chunks (the first and last pipeline
    stage, as Megatron's ``decoder_first/last_pipeline_num_layers``); they may be 0 (an
    embedding-only first chunk or a head-only last chunk); every other chunk gets at least one
    layer and the rest is spread evenly.
    """
    if num_chunks < 1:
        raise ValueError(f"need at least one chunk, got num_chunks={num_chunks}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    for name, v in (("first_chunk_layers", first_chunk_layers), ("last_chunk_layers", last_chunk_layers)):
        if v is not None and v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if num_chunks == 1:
        if first_chunk_layers not in (None, num_layers) or last_chunk_layers not in (None, num_layers):
            raise ValueError(f"one chunk holds all {num_layers} layers; explicit first/last "
                             f"counts {first_chunk_layers}/{last_chunk_layers} disagree")
        if num_layers < 1:
            raise ValueError("cannot split 0 layers into 1 chunk")
        return [num_layers]
    fixed = {}
    if first_chunk_layers is not None:
        fixed[0] = first_chunk_layers
    if last_chunk_layers is not None:
        fixed[num_chunks - 1] = last_chunk_layers
    free = [c for c in range(num_chunks) if c not in fixed]
    rest = num_layers - sum(fixed.values())
    if rest < len(free) or (not free and rest != 0):
        raise ValueError(
            f"cannot split {num_layers} layers into {num_chunks} chunks "
            f"(first={first_chunk_layers}, last={last_chunk_layers}): {rest} layers left for "
            f"{len(free)} remaining chunks, each needs at least one")
    counts = [0] * num_chunks
    for c, v in fixed.items():
        counts[c] = v
    if free:
        base, extra = divmod(rest, len(free))
        for i, c in enumerate(free):
            counts[c] = base + (1 if i < extra else 0)
    return counts


@dataclass(frozen=True)
class PipelineLayout:
    """Loop placement of C = P*V chunks: chunk c lives on rank ``c % P``, virtual stage ``c // P``."""

    num_layers: int
    pp_size: int
    vpp_size: int = 1
    first_chunk_layers: int | None = None
    last_chunk_layers: int | None = None

    def __post_init__(self):
        if self.pp_size < 1 or self.vpp_size < 1:
            raise ValueError(f"pp_size and vpp_size must be >= 1, got {self.pp_size}, {self.vpp_size}")
        self.chunk_layers  # validates the split eagerly

    @property
    def num_chunks(self) -> int:
        return self.pp_size * self.vpp_size

    @property
    def chunk_layers(self) -> list[int]:
        return split_layers(self.num_layers, self.num_chunks, self.first_chunk_layers,
                            self.last_chunk_layers)

    def layer_range(self, chunk: int) -> range:
        """Global layer indices of ``chunk``."""
        counts = self.chunk_layers
        start = sum(counts[:chunk])
        return range(start, start + counts[chunk])

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp_size

    def virtual_stage_of(self, chunk: int) -> int:
        return chunk // self.pp_size

    def chunks_of_rank(self, rank: int) -> list[int]:
        return chunks_of_rank(rank, self.pp_size, self.vpp_size)


def chunks_of_rank(rank: int, pp_size: int, vpp_size: int) -> list[int]:
    """Global chunk indices held by pipeline ``rank``, in virtual-stage order."""
    if not 0 <= rank < pp_size:
        raise ValueError(f"rank {rank} outside pipeline of size {pp_size}")
    return [v * pp_size + rank for v in range(vpp_size)]
