"""A rank's training state in and out of a checkpoint, keyed by global tensor names.

``rank_state`` is what one rank writes (its pieces of the model and optimizer, stored once
across replicas; its RNG, data position and expert loads) and the piece index the manifest
merges; ``load_rank_state`` fills a ``TrainState`` of any parallel layout from any
checkpoint written this way (``k3train.trainer.reshard`` assembles the pieces). See
docs/checkpoints.md.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from k3train.errors import CheckpointError
from k3train.trainer.checkpoint import verify_checkpoint
from k3train.trainer.host_buffers import HostBuffers
from k3train.trainer.optim_state import (load_main_param_values, load_per_param_state,
                                         main_param_values, param_kinds, per_param_state)
from k3train.trainer.reshard import PieceReader, global_names, local_pieces, writes_piece

FORMAT = "k3train.global/1"


def _length(t: torch.Tensor, piece) -> int:
    return t.shape[piece.dim] if piece.dim is not None else 0


def _param_names(model) -> dict[int, str]:
    """{id(parameter): global name} for this rank's parameters."""
    names = global_names(model)
    return {id(p): names[n] for n, p in model.named_parameters()}


def optimizer_kinds(model, optimizer) -> dict[str, str]:
    """{global name: "adamw" or "muon"}: which optimizer updates each of this rank's parameters
    (the parameter table's assignment under ``optim.name``; both optimizers' groups carry it)."""
    names = _param_names(model)
    return {names[i]: kind for i, kind in param_kinds(optimizer).items() if i in names}


def saved_kind(entry: dict) -> str | None:
    """The optimizer a checkpoint's tensor entry was trained with: recorded since this version,
    else told by its state keys (AdamW's moments or Muon's momentum); None without state."""
    if entry.get("optimizer"):
        return entry["optimizer"]
    keys = set(entry.get("optim", []))
    return "adamw" if "exp_avg" in keys else "muon" if "momentum_buffer" in keys else None


def _expert_names(state) -> set[str]:
    names = _param_names(state.model)
    return {names[id(p)] for layer in state.moe_layers for p in layer.experts.parameters()}


def rank_state(state, step: int, data_state: dict, data_source: str = "", *,
               host: HostBuffers | None = None, data_record: dict | None = None) -> tuple[dict, dict]:
    """(this rank's file content, its index {global name: piece json with "optim" keys}).
    data_source names the training data (a resume on other data warns naming both);
    data_record (``restore.data_record``) goes into the manifest as ``data``.
    host: given, every tensor of the content is a copy in ``host``'s buffers (on CPU too, where
    ``.cpu()`` would alias the live weights), so the next steps may run while a background
    thread writes it (``train.async_save``); the buffers are refilled by the next snapshot.
    Collective (ZeRO-1 gathers its optimizer shards): every rank calls it."""
    ctx = state.parallel
    pieces = local_pieces(state.model, state.info.tp, ctx.tp_rank)
    optim, optim_step = per_param_state(state.optimizer)
    by_name = {g: optim[i] for i, g in _param_names(state.model).items() if i in optim}
    # bf16 weights: their fp32 main values are stored under the weights' names (docs/memory.md).
    mains = main_param_values(state.optimizer)
    main_by_name = {g: mains[i] for i, g in _param_names(state.model).items() if i in mains}
    experts = _expert_names(state)
    kinds = optimizer_kinds(state.model, state.optimizer)
    tensors, moments, index = {}, {}, {}
    for g, (t, piece) in pieces.items():
        if not writes_piece(piece, g in experts, ctx):
            continue
        t = main_by_name.get(g, t)
        tensors[g] = host.copy(("tensor", g), t) if host is not None else t.detach().cpu()
        entry = piece.as_json(_length(t, piece))
        if g in by_name:
            moments[g] = (host.copy_tree(("optim", g), by_name[g]) if host is not None
                          else {k: v.cpu() for k, v in by_name[g].items()})
            entry["optim"] = sorted(moments[g])
        if g in kinds:
            entry["optimizer"] = kinds[g]
        index[g] = entry
    content = {"format": FORMAT, "step": step, "tensors": tensors, "optim": moments, "optim_step": optim_step,
               "optim_name": state.cfg.optim.name,
               "moe_loads": state.moe_stats.state_dict() if state.moe_stats is not None else None,
               "rng": torch.get_rng_state(),
               "cuda_rng": torch.cuda.get_rng_state() if state.device.type == "cuda" else None,
               "data": data_state, "data_source": data_source, "data_record": data_record}
    if host is not None:  # the RNG states are new tensors already
        content["moe_loads"] = host.copy_tree("moe_loads", content["moe_loads"])
        content["data"] = copy.deepcopy(data_state)
        host.ready()
    return content, index


def weights_state(model, step: int = 0, source: str = "") -> tuple[dict, dict]:
    """(file content, piece index) of a one-process ``model``'s weights alone, no optimizer or
    data state: what ``k3train import`` writes for ``train.init_from``."""
    tensors, index = {}, {}
    for g, (t, piece) in local_pieces(model, 1, 0).items():
        tensors[g] = t.detach().cpu()
        index[g] = piece.as_json(_length(t, piece))
    content = {"format": FORMAT, "step": step, "tensors": tensors, "optim": {}, "optim_step": None,
               "moe_loads": None, "weights_only": True, "source": source}
    return content, index


def load_weights(model, path: Path, manifest: dict, tp: int, tp_rank: int, optimizer=None) -> None:
    """Copy every tensor of ``model`` (this rank's part, any layout) from checkpoint ``path``;
    ``optimizer``: the run's, whose fp32 main parameters (bf16 weights) take the same values."""
    reader = PieceReader(path, manifest["tensors"])
    pid_of = {g: i for i, g in _param_names(model).items()}
    try:
        with torch.no_grad():
            for g, (t, piece) in local_pieces(model, tp, tp_rank).items():
                value = reader.local(g, piece, _length(t, piece))
                t.copy_(value)
                if optimizer is not None and g in pid_of:
                    load_main_param_values(optimizer, {pid_of[g]: value})
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path} does not fit this model ({exc}); use the config it was "
                              f"trained with (config.yaml of its run directory)") from None


def load_weights_from_tensors(model, tensors: dict, tp: int, tp_rank: int, where: str,
                              optimizer=None) -> None:
    """Copy every tensor of ``model`` (this rank's part, any layout) from ``tensors``, the whole
    one-process model by global name (a Hugging Face import); ``optimizer``: as ``load_weights``."""
    pid_of = {g: i for i, g in _param_names(model).items()}
    with torch.no_grad():
        for g, (t, piece) in local_pieces(model, tp, tp_rank).items():
            full = tensors.get(g)
            if full is None or tuple(full.shape) != piece.global_shape:
                have = "missing" if full is None else f"{list(full.shape)}"
                raise CheckpointError(f"{where} does not fit this model: {g} is {have}, the model needs "
                                      f"{list(piece.global_shape)}")
            value = full if piece.dim is None else full.narrow(piece.dim, piece.offset, _length(t, piece))
            t.copy_(value)
            if optimizer is not None and g in pid_of:
                load_main_param_values(optimizer, {pid_of[g]: value})


def _source_file(manifest: dict, coords: dict, keys: tuple[str, ...]) -> str | None:
    for rank, theirs in sorted(manifest.get("coords", {}).items(), key=lambda kv: int(kv[0])):
        if all(theirs.get(k) == coords.get(k) for k in keys):
            return f"rank_{int(rank):05d}.pt"
    return None


def load_rank_state(state, path: Path, manifest: dict, layout: dict, coords: dict, *,
                    fresh: frozenset = frozenset(), reset: frozenset = frozenset()
                    ) -> tuple[int, dict, str | None, list[str]]:
    """Fill ``state`` (a TrainState) from ``path``; returns (step, data state, the data source
    it was trained on (None if unrecorded), notes for the log). fresh: global names the
    checkpoint lacks, kept as initialised (``train.allow_model_change``); reset: names whose
    optimizer state starts fresh (``train.allow_optimizer_change``).

    Weights and optimizer come from the pieces, whatever layout wrote them. The RNG state comes
    from the same rank when the layout is unchanged, else from rank 0. The data position counts
    global windows, so any rank's is every rank's. Expert loads (metrics only) are kept when the
    pipeline split is unchanged, else restarted (a note says so)."""
    ctx = state.parallel
    reader = PieceReader(path, manifest["tensors"])
    pieces = local_pieces(state.model, state.info.tp, ctx.tp_rank)
    pid_of = {g: i for i, g in _param_names(state.model).items()}
    with torch.no_grad():
        for g, (t, piece) in pieces.items():
            if g not in fresh:
                value = reader.local(g, piece, _length(t, piece))
                t.copy_(value)
                if g in pid_of:  # bf16 weights: the fp32 main parameter from the same value
                    load_main_param_values(state.optimizer, {pid_of[g]: value})
    optim = {}
    for pid, g in _param_names(state.model).items():
        keys = [] if g in reset else manifest["tensors"].get(g, {}).get("optim", [])
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
    return int(manifest["step"]), own["data"], own.get("data_source"), notes


def consolidated_state(path: Path, optimizer: bool = True) -> dict:
    """The whole model of checkpoint ``path`` (any layout) as one process holds it:
    ``{"step", "model": {global name: tensor}, "optim": {global name: {key: tensor}}}``
    (``optim`` empty with ``optimizer=False``). Verifies every checksum first.

    A checkpoint of the older per-rank format is read only when one process wrote it."""
    path = Path(path)
    manifest = verify_checkpoint(path, 1, None) if "tensors" in peek_manifest(path) else None
    if manifest is None:
        manifest = verify_checkpoint(path, 1)  # raises naming the world size it was written by
        state = torch.load(path / "rank_00000.pt", map_location="cpu", weights_only=False)
        model = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
        return {"step": manifest["step"], "model": model, "optim": {}}
    reader = PieceReader(path, manifest["tensors"])
    model = {g: reader.full(g) for g in manifest["tensors"]}
    optim = ({g: {k: reader.full(g, "optim", k) for k in e.get("optim", [])}
              for g, e in manifest["tensors"].items() if e.get("optim")} if optimizer else {})
    return {"step": manifest["step"], "model": model, "optim": optim}


def peek_manifest(path: Path) -> dict:
    """The manifest's JSON without checks (``verify_checkpoint`` does those)."""
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
