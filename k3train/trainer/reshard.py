"""Tensors by global name: what lets a checkpoint written under one parallel layout load under any other.

The *global name* of a tensor is its name in the one-process model (``build_model``'s
``state_dict``): a pipeline rank's ``"1.layers.0.mixer.q_conv"`` (chunk 1 holding layers 4..7)
is ``"layers.4.mixer.q_conv"``. A rank holds a *piece* of each global tensor: the whole of it
(``dim`` None), or the slice ``[offset, offset + length)`` of dimension ``dim`` where tensor
parallelism shards heads / channels (megatron's ``partition_dim``) or expert parallelism
shards the experts (dim 0 of ``GroupedExperts`` weights).

A save writes each piece once, from the lowest replica (data-parallel rank 0 of its group, and
tensor-parallel rank 0 for what TP does not shard); the manifest indexes every piece by global
name. A load assembles each global tensor from the pieces it needs and takes this rank's slice.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from k3train.errors import CheckpointError
from moe import GroupedExperts


@dataclass(frozen=True)
class Piece:
    """Where a local tensor sits in its global tensor: ``global_shape``; ``dim`` None (whole) or
    the sharded dim with this piece's ``offset`` (its length is the local size of ``dim``)."""
    global_shape: tuple[int, ...]
    dim: int | None
    offset: int

    def as_json(self, length: int) -> dict:
        return {"shape": list(self.global_shape), "dim": self.dim, "offset": self.offset, "length": length}


def _chunks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(state-dict prefix, chunk) of each chunk this rank holds: ``("", model)`` at pp=1."""
    if hasattr(model, "layer_range"):
        yield "", model
        return
    for key, chunk in model.items():  # LocalChunks: keyed by global chunk index
        yield f"{key}.", chunk


def global_names(model: nn.Module) -> dict[str, str]:
    """{local state-dict name: global name} for every tensor entry of ``model``'s state_dict."""
    out = {}
    for prefix, chunk in _chunks(model):
        start = chunk.layer_range[0]
        for name in chunk.state_dict(keep_vars=True):
            parts = name.split(".")
            if parts[0] == "layers":
                parts[1] = str(start + int(parts[1]))
            out[prefix + name] = ".".join(parts)
    return out


def _expert_modules(model: nn.Module) -> dict[str, nn.Module]:

    return {name: mod for name, mod in model.named_modules() if isinstance(mod, GroupedExperts)}


def local_pieces(model: nn.Module, tp: int, tp_rank: int) -> dict[str, tuple[torch.Tensor, Piece]]:
    """{global name: (local tensor, its piece)} for every tensor of this rank's model part."""
    experts = _expert_modules(model)
    names = global_names(model)
    out = {}
    for local, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):  # megatron layers store a None _extra_state
            continue
        owner, _, leaf = local.rpartition(".")
        shape = tuple(t.shape)
        if owner in experts and leaf in ("w_gate", "w_up", "w_down"):
            mod = experts[owner]
            piece = Piece((mod.total_experts, *shape[1:]), 0, mod.expert_offset)
        elif getattr(t, "tensor_model_parallel", False):
            d = t.partition_dim
            piece = Piece(shape[:d] + (shape[d] * tp,) + shape[d + 1:], d, shape[d] * tp_rank)
        else:
            piece = Piece(shape, None, 0)
        out[names[local]] = (t.detach(), piece)
    return out


def _rank_in(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def writes_piece(piece: Piece, expert: bool, parallel) -> bool:
    """Whether this rank writes ``piece``: the first of its replicas, so each is stored once.

    parallel: the rank's ``ParallelContext``. Experts are replicated over the expert-data-parallel
    group, everything else over the data-parallel group and the context-parallel ranks of
    each replica (megatron-core's expert-DP group spans CP already); what TP does not shard
    (experts included: every TP rank holds its EP rank's experts whole), over TP too."""
    replica = _rank_in(parallel.edp_group) if expert else parallel.dp_rank + parallel.cp_rank
    if replica != 0:
        return False
    tp_sharded = piece.dim is not None and not expert
    return tp_sharded or parallel.tp_rank == 0


class PieceReader:
    """Assembles global tensors from a checkpoint's pieces (``index``: the manifest's
    ``tensors`` entry) reading each rank file at most once, memory-mapped."""

    def __init__(self, path: Path, index: dict):
        self.path, self.index, self._files = path, index, {}

    def file(self, name: str) -> dict:
        if name not in self._files:
            self._files[name] = torch.load(self.path / name, map_location="cpu", weights_only=False, mmap=True)
        return self._files[name]

    def full(self, name: str, section: str = "tensors", key: str | None = None) -> torch.Tensor:
        """The whole global tensor ``name`` (``section`` "tensors", or "optim" with state ``key``)."""
        entry = self.index.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name}: it was saved from another model "
                                  f"(compare its config.yaml with this run's)")
        shape = tuple(entry["shape"])
        out, covered = None, 0
        for p in entry["pieces"]:
            stored = self.file(p["file"])[section][name]
            t = stored if key is None else stored.get(key)
            if t is None:
                raise CheckpointError(f"checkpoint {self.path}: {p['file']} lacks {section} state {key!r} of {name}")
            if p["dim"] is None:
                return t.clone()
            if out is None:
                out = torch.empty(shape, dtype=t.dtype)
            out.narrow(p["dim"], p["offset"], p["length"]).copy_(t)
            covered += p["length"]
        if out is None or covered != shape[entry["pieces"][0]["dim"]]:
            raise CheckpointError(f"checkpoint {self.path}: the pieces of {name} cover {covered} of "
                                  f"{shape} along dim {entry['pieces'][0]['dim'] if entry['pieces'] else '?'}; "
                                  f"the checkpoint is incomplete")
        return out

    def local(self, name: str, piece: Piece, length: int, section: str = "tensors",
              key: str | None = None) -> torch.Tensor:
        """This rank's slice (``piece``, ``length`` along its dim) of global tensor ``name``."""
        full = self.full(name, section, key)
        if tuple(full.shape) != piece.global_shape:
            # torch's own wording: the trainer turns it into its one-line "does not fit" refusal.
            raise ValueError(f"size mismatch for {name}: the checkpoint holds {list(full.shape)}, "
                             f"this model has {list(piece.global_shape)}")
        return full if piece.dim is None else full.narrow(piece.dim, piece.offset, length)
