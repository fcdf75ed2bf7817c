"""A rank's training state in and out of a checkpoint, keyed by global tensor names.

``rank_state`` is what one rank writes (its pieces of the model and optimizer, stored once
across replicas; its RNG, data position and expert loads) and the piece index the manifest
merges; ``load_rank_state`` fills a ``TrainState`` of any parallel layout from any
checkpoint written this way (``k3train.trainer.reshard`` assembles the pieces). See
docs/checkpoints.md.
"""
from __future__ import annotations

from pathlib import Path

import torch

from k3train.errors import CheckpointError
from k3train.trainer.optim_state import load_per_param_state, per_param_state
from k3train.trainer.reshard import PieceReader, global_names, local_pieces, writes_piece

FORMAT = "k3train.global/1"


def _length(t: torch.Tensor, piece) -> int:
    return t.shape[piece.dim] if piece.dim is not None else 0


def _param_names(model) -> dict[int, str]:
    """{id(parameter): global name} for this rank's parameters."""
    names = global_names(model)
    return {id(p): names[n] for n, p in model.named_parameters()}


def _expert_names(state) -> set[str]:
    names = _param_names(state.model)
    return {names[id(p)] for layer in state.moe_layers for p in layer.experts.parameters()}


def rank_state(state, step: int, data_state: dict) -> tuple[dict, dict]:
    """(this rank's file content, its index {global name: piece json with "optim" keys}).
    Collective (ZeRO-1 gathers its optimizer shards): every rank calls it."""
    ctx = state.parallel
    pieces = local_pieces(state.model, state.info.tp, ctx.tp_rank)
    optim, optim_step = per_param_state(state.optimizer)
    by_name = {g: optim[i] for i, g in _param_names(state.model).items() if i in optim}
    experts = _expert_names(state)
    tensors, moments, index = {}, {}, {}
    for g, (t, piece) in pieces.items():
        if not writes_piece(piece, g in experts, ctx):
            continue
        tensors[g] = t.cpu()
        entry = piece.as_json(_length(t, piece))
        if g in by_name:
            moments[g] = {k: v.cpu() for k, v in by_name[g].items()}
            entry["optim"] = sorted(moments[g])
        index[g] = entry
    content = {"format": FORMAT, "step": step, "tensors": tensors, "optim": moments, "optim_step": optim_step,
               "moe_loads": state.moe_stats.state_dict() if state.moe_stats is not None else None,
               "rng": torch.get_rng_state(),
               "cuda_rng": torch.cuda.get_rng_state() if state.device.type == "cuda" else None,
               "data": data_state}
    return content, index


def load_weights(model, path: Path, manifest: dict, tp: int, tp_rank: int) -> None:
    """Copy every tensor of ``model`` (this rank's part, any layout) from checkpoint ``path``."""
    reader = PieceReader(path, manifest["tensors"])
    with torch.no_grad():
        for g, (t, piece) in local_pieces(model, tp, tp_rank).items():
            t.copy_(reader.local(g, piece, _length(t, piece)))


def _source_file(manifest: dict, coords: dict, keys: tuple[str, ...]) -> str | None:
    for rank, theirs in sorted(manifest.get("coords", {}).items(), key=lambda kv: int(kv[0])):
        if all(theirs.get(k) == coords.get(k) for k in keys):
            return f"rank_{int(rank):05d}.pt"
    return None


def load_rank_state(state, path: Path, manifest: dict, layout: dict, coords: dict) -> tuple[int, dict, list[str]]:
    """Fill ``state`` (a TrainState) from ``path``; returns (step, data state, notes for the log).

    Weights and optimizer come from the pieces, whatever layout wrote them. The RNG state comes
    from the same rank when the layout is unchanged, else from rank 0. The data position counts
    global windows, so any rank's is every rank's. Expert loads (metrics only) are kept when the
    pipeline split is unchanged, else restarted (a note says so)."""
    ctx = state.parallel
    reader = PieceReader(path, manifest["tensors"])
    pieces = local_pieces(state.model, state.info.tp, ctx.tp_rank)
    with torch.no_grad():
        for g, (t, piece) in pieces.items():
            t.copy_(reader.local(g, piece, _length(t, piece)))
    optim = {}
    for pid, g in _param_names(state.model).items():
        keys = manifest["tensors"].get(g, {}).get("optim", [])
        t, piece = pieces[g]
        if keys:
            optim[pid] = {k: reader.local(g, piece, _length(t, piece), "optim", k) for k in keys}
    load_per_param_state(state.optimizer, optim, int(manifest["optim_step"]))

    saved_layout, notes = manifest["layout"], []
    same = all(saved_layout.get(k) == layout.get(k) for k in ("tp", "pp", "vpp", "ep", "dp", "zero1"))
    rank = state.info.rank
    own = reader.file(f"rank_{rank:05d}.pt") if same else reader.file("rank_00000.pt")
    torch.set_rng_state(own["rng"])
    if own.get("cuda_rng") is not None and state.device.type == "cuda":
        torch.cuda.set_rng_state(own["cuda_rng"])
    if state.moe_stats is not None:
        same_split = all(saved_layout.get(k) == layout.get(k) for k in ("pp", "vpp"))
        src = _source_file(manifest, coords, ("pp",)) if same_split else None
        loads = reader.file(src).get("moe_loads") if src else None
        if loads is not None:
            state.moe_stats.load_state_dict(loads)
        elif saved_layout.get("pp") != layout.get("pp") or saved_layout.get("vpp") != layout.get("vpp"):
            notes.append("the expert-load statistics restart (the pipeline split changed)")
    if "data" not in own:
        raise CheckpointError(f"checkpoint {path} has no data position in its rank files")
    return int(manifest["step"]), own["data"], notes
