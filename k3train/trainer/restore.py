"""The one way into a checkpoint: find it, build its run config, refuse what cannot be read,
and put its weights (or its whole training state) into a model.

Every command that opens a checkpoint comes through here: ``train`` (``--resume`` and
``train.init_from``), ``eval``, ``generate``, ``export`` (both formats) and the tests.

* ``resolve_checkpoint``: a run directory, its ``checkpoints/`` directory or one
  ``step_XXXXXXXX`` directory, alike -> the step directory (``latest`` where there is a choice).
* ``run_config``: the config the checkpoint was trained with (``config.yaml`` of its run
  directory, or ``--config``) with the user's overrides; in a one-process world the parallel
  layout defaults to one process, so a checkpoint of any layout opens without
  ``parallel.*=1`` overrides (checkpoints are stored by global tensor name).
* ``open_checkpoint``: verify every checksum; refuse the older per-rank format.
* ``load_weights_into``, ``read_weights``, ``load_model``: weights into a (possibly sharded)
  model, the whole one-process state dict, a one-process model.
* ``restore_training``, ``init_from``: the trainer's resume and fine-tuning start.

See docs/checkpoints.md for the format.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from k3train.config import RunConfig, load_config
from k3train.config.schema import ParallelConfig
from k3train.data.dataset import dataset_content_hash
from k3train.errors import CheckpointError, RunDirError, UsageError
from k3train.hf.load import INDEX as HF_INDEX, load_hf, merge_model_config
from k3train.model.model import build_model
from k3train.trainer.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint
from k3train.trainer.run_dir import load_error
from k3train.trainer.reshard import local_pieces
from k3train.trainer.state_io import (consolidated_state, load_rank_state, load_weights,
                                      load_weights_from_tensors, optimizer_kinds, peek_manifest, saved_kind)

LAYOUT_SHOWN = ("tp", "pp", "vpp", "ep", "dp", "zero1")
# Every rank count to 1 (parallel.cp_partition is no count: it has no layout to undo).
_ONE_PROCESS = [f"parallel.{k}=1" for k, f in ParallelConfig.model_fields.items() if f.annotation is int]


def layout_text(layout: dict) -> str:
    return " ".join(f"{k} {layout.get(k)}" for k in LAYOUT_SHOWN)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The step directory that ``path`` names: a ``step_XXXXXXXX`` directory itself, a
    ``checkpoints/`` directory (its ``latest``), or a run directory (its
    ``checkpoints/latest``). Raises CheckpointError naming what ``path`` lacks."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    for ckpt_dir in (p, p / "checkpoints"):
        pointer = ckpt_dir / "latest"
        if pointer.exists() or pointer.is_symlink():  # latest_checkpoint refuses a malformed one in one line
            return latest_checkpoint(ckpt_dir)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist; give a run directory, its checkpoints/ "
                              f"directory or a step_XXXXXXXX directory")
    raise CheckpointError(f"{p} holds no checkpoint: expected a run directory (with checkpoints/latest), a "
                          f"checkpoints/ directory (with 'latest') or a step_XXXXXXXX directory (with manifest.json)")


def world_size() -> int:
    """The processes this command runs in: the live world, else torchrun's, else 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_config(step_dir: Path, config: str | os.PathLike | None = None, overrides: list[str] | tuple = (),
               *, one_process: bool | None = None) -> tuple[RunConfig, Path]:
    """(run config, its file) for using ``step_dir``: ``config`` (default: the ``config.yaml``
    of the checkpoint's run directory), then ``overrides`` (``train.init_from`` is cleared: the
    weights come from the checkpoint). one_process (default: this command runs in one
    process): the layout starts as one process, before the overrides, so a PP=2 checkpoint
    opens in one process while ``parallel.tp=2`` under torchrun still applies."""
    path = Path(config) if config else step_dir.parent.parent / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"no run config at {path}; pass --config (the YAML the checkpoint was trained with)")
    if one_process is None:
        one_process = world_size() == 1
    layout = _ONE_PROCESS if one_process else []
    return load_config(path, [*layout, *overrides, "train.init_from=null"]), path


def open_checkpoint(step_dir: Path, what: str = "use it") -> dict:
    """Verify ``step_dir`` (manifest and every checksum) and return its manifest; refuse the
    older per-rank format, which only resuming under its own layout reads."""
    peeked = peek_manifest(step_dir)  # unreadable or malformed: verify_checkpoint names the problem
    if isinstance(peeked, dict) and "files" in peeked and "tensors" not in peeked:
        raise UsageError(f"{step_dir} is a checkpoint of the older per-rank format; resume it once with its own "
                         f"layout (it is then saved by global name) to {what}")
    return verify_checkpoint(step_dir, world_size(), None)


def load_weights_into(model, step_dir: Path, manifest: dict, tp: int = 1, tp_rank: int = 0,
                      optimizer=None) -> None:
    """Copy this rank's part of every tensor of ``model`` (any layout) from ``step_dir``;
    ``optimizer``: the run's, whose fp32 main parameters (bf16 weights) take the same values."""
    load_weights(model, step_dir, manifest, tp, tp_rank, optimizer)


@dataclass(frozen=True)
class Weights:
    """A checkpoint's whole model as one process holds it, and where it came from."""

    state: dict          # {state-dict name: tensor} of the one-process model
    cfg: RunConfig
    step_dir: Path
    config_path: Path
    step: int


def read_weights(checkpoint: str | os.PathLike, config: str | os.PathLike | None = None,
                 overrides: list[str] | tuple = ()) -> Weights:
    """The one-process model's state dict of a checkpoint of any layout (its pieces assembled
    by global name, every checksum verified), with its run config (one-process layout)."""
    step_dir = resolve_checkpoint(checkpoint)
    cfg, cfg_path = run_config(step_dir, config, overrides, one_process=True)
    try:
        whole = consolidated_state(step_dir, optimizer=False)
    except FileNotFoundError as exc:  # a live run pruned it (no lock is taken: docs/checkpoints.md#export)
        raise CheckpointError(f"{exc.filename or step_dir} vanished while it was read: a live run removes its "
                              f"older checkpoints (checkpoint.keep_last); run the command again (it takes "
                              f"the newest step) or pass a step directory the run keeps") from None
    return Weights(whole["model"], cfg, step_dir, cfg_path, int(whole["step"]))


def load_model(checkpoint: str | os.PathLike, config: str | os.PathLike | None = None,
               overrides: list[str] | tuple = (), device: str | torch.device = "cpu"):
    """(one-process model on ``device`` with the checkpoint's weights, run config, step dir) of a
    checkpoint of any layout. The dispatcher is the local one and nothing is compiled (the
    compiled pieces are shape-specialised: a sequence growing by one token per call would
    compile once per length). Needs megatron's (one-process) groups."""
    step_dir = resolve_checkpoint(checkpoint)
    cfg, _ = run_config(step_dir, config, overrides, one_process=True)
    device = torch.device(device)
    cfg = cfg.model_copy(update={"kernels": cfg.kernels.model_copy(update={"compile": False}),
                                 "moe": cfg.moe.model_copy(update={"dispatcher": "local"}),
                                 "train": cfg.train.model_copy(update={"device": device.type})})
    manifest = open_checkpoint(step_dir)
    model = build_model(cfg).to(device)
    load_weights_into(model, step_dir, manifest)
    return model, cfg, step_dir


def data_source(cfg: RunConfig) -> str:
    """What the run trains on, as recorded in its checkpoints."""
    return f"data.source={cfg.data.source} (tokenizer {cfg.data.tokenizer})"


_BUILT_IN_SOURCES = ("embedded", "stdlib", "mqar")  # made by k3train, no prepared dataset


def data_record(cfg: RunConfig) -> dict:
    """What a checkpoint's manifest records of the run's data (its ``data`` entry): ``source``
    (``data_source``) and ``content_sha256``, per dataset prefix in ``data.source`` /
    ``data.sources`` order the hash prepare-data recorded in its meta file (None for a built-in
    source or a dataset without one). The hash, not the path, names the data: a dataset
    re-prepared at the same prefix is other data, a moved one is not."""
    paths = [s.path for s in cfg.data.sources] or [cfg.data.source]
    hashes = [None if p in _BUILT_IN_SOURCES else dataset_content_hash(p) for p in paths]
    return {"source": data_source(cfg), "content_sha256": hashes}


def _hashes(hashes: list) -> str:
    return "[" + ", ".join("none" if h is None else str(h)[:12] for h in hashes) + "]"


def _data_change(saved, now: dict) -> str | None:
    """How the data of a manifest's ``data`` record differs from ``now``, or None (also for a
    checkpoint that records none)."""
    if not isinstance(saved, dict):
        return None
    theirs, ours = saved.get("content_sha256") or [], now["content_sha256"]
    if any(theirs) or any(ours):  # prepared datasets: their content decides
        if theirs == ours:
            return None
        return (f"dataset content sha256 {_hashes(theirs)} in the checkpoint, {_hashes(ours)} now "
                f"({saved.get('source')} then, {now['source']} now)")
    if saved.get("source") != now["source"]:
        return f"{saved.get('source')} in the checkpoint, {now['source']} now"
    return None


def _check_data(manifest: dict, cfg: RunConfig, path: Path, main: bool) -> bool:
    """Refuse (one line) a resume onto other data than ``path`` was trained on unless
    ``train.allow_data_change``, which warns instead. True when the manifest records the data
    (the older rank-file comparison is then not needed)."""
    change = _data_change(manifest.get("data"), data_record(cfg))
    if change is not None and not cfg.train.allow_data_change:
        raise CheckpointError(f"--resume: checkpoint {path} was trained on other data: {change}; set "
                              f"train.allow_data_change=true to continue the run on this data, or start a "
                              f"new run directory with train.init_from={path} (nothing was changed)")
    if change is not None and main:
        print(f"[k3train] WARNING: train.allow_data_change: {path} was trained on other data: {change}. "
              f"The optimizer, schedule and data position continue from step {manifest['step']}")
    return isinstance(manifest.get("data"), dict)


def _every_rank(value) -> list:
    """Every rank's ``value`` (collective where there is more than one rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _some(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


@dataclass(frozen=True)
class Changes:
    """How a checkpoint differs from the run's config: tensor names on one side only, and
    parameters whose optimizer differs ({global name: (saved kind, config's kind)})."""

    only_checkpoint: frozenset
    only_config: frozenset
    optimizer: dict
    optim_names: tuple   # (saved optim.name or None when unrecorded, config's optim.name)


def compare_with_checkpoint(state, manifest: dict) -> Changes:
    """The model and optimizer differences between ``state`` (a TrainState; its ranks together
    hold the whole model) and a checkpoint stored by global name. Collective."""
    mine = {g for g in local_pieces(state.model, state.info.tp, state.parallel.tp_rank)}
    kinds = optimizer_kinds(state.model, state.optimizer)
    everyone = _every_rank((sorted(mine), kinds))
    model_names = set().union(*(set(names) for names, _ in everyone))
    config_kinds = {g: k for _, theirs in everyone for g, k in theirs.items()}
    saved = manifest["tensors"]
    moved = {}
    for g, kind in config_kinds.items():
        before = saved_kind(saved[g]) if g in saved else None
        if before is not None and before != kind:
            moved[g] = (before, kind)
    return Changes(frozenset(set(saved) - model_names), frozenset(model_names - set(saved)), moved,
                   (manifest.get("optim_name"), state.cfg.optim.name))


def _accept_changes(changes: Changes, state, path: Path, run_dir: Path, main: bool) -> None:
    """Refuse (one line naming the difference and the field that accepts it) or, where that
    field is true, print what is dropped, initialised or reset."""
    train = state.cfg.train
    fix = f"or resume with the config it was saved with ({run_dir / 'config.yaml'} has it)"
    if changes.only_checkpoint or changes.only_config:
        parts = [f"{len(names)} tensor(s) only in the {side} ({_some(names)})" for side, names in
                 (("checkpoint", changes.only_checkpoint), ("config's model", changes.only_config)) if names]
        if not train.allow_model_change:
            raise CheckpointError(f"--resume: checkpoint {path} holds another model than this config: "
                                  f"{'; '.join(parts)}; set train.allow_model_change=true to drop the "
                                  f"checkpoint's extra tensors and initialise the new ones, {fix}")
        if main:
            if changes.only_checkpoint:
                print(f"[k3train] train.allow_model_change: dropped {len(changes.only_checkpoint)} checkpoint "
                      f"tensor(s) this model lacks: {', '.join(sorted(changes.only_checkpoint))}; later "
                      f"checkpoints do not hold them")
            if changes.only_config:
                print(f"[k3train] train.allow_model_change: {len(changes.only_config)} tensor(s) not in the "
                      f"checkpoint start from their initialisation: {', '.join(sorted(changes.only_config))}")
    saved_name, name = changes.optim_names
    renamed = saved_name is not None and saved_name != name
    if changes.optimizer or renamed:
        pairs = sorted({f"{a} -> {b}" for a, b in changes.optimizer.values()})
        what = (f"optim.name {saved_name} in the checkpoint, {name} in this config" if renamed else
                f"the parameter table gives {len(changes.optimizer)} parameter(s) another optimizer")
        moved = (f" ({len(changes.optimizer)} parameter(s) {', '.join(pairs)}: {_some(changes.optimizer)})"
                 if changes.optimizer else "")
        if not train.allow_optimizer_change:
            raise CheckpointError(f"--resume: checkpoint {path} was trained with another optimizer: {what}{moved}; "
                                  f"set train.allow_optimizer_change=true to start their optimizer state fresh, {fix}")
        if main:
            print(f"[k3train] train.allow_optimizer_change: {what}; optimizer state reset (fresh) for "
                  f"{len(changes.optimizer)} parameter(s): {', '.join(sorted(changes.optimizer))}")


def restore_training(state, data, path: Path, layout: dict, run_dir: Path, main: bool) -> int:
    """``--resume``: load checkpoint ``path`` into ``state`` (a TrainState) and ``data``; returns
    its step. A checkpoint stored by global name loads under any layout; an older one (per-rank
    state dicts) only under its own layout or another data-parallel size."""
    ctx = state.parallel
    coords = {"pp": ctx.pp_rank, "tp": ctx.tp_rank, "ep": ctx.ep_rank, "dp": ctx.dp_rank}
    manifest = verify_checkpoint(path, state.info.world_size, layout)
    if manifest["step"] > state.cfg.train.steps:  # before anything is loaded or written
        raise RunDirError(f"--resume: {path.name} is step {manifest['step']}, past train.steps="
                          f"{state.cfg.train.steps}; raise train.steps to at least {manifest['step']} to "
                          f"continue the run (nothing was changed)")
    recorded = _check_data(manifest, state.cfg, path, main)  # refused: nothing loaded or written
    try:
        if "tensors" in manifest:
            changes = compare_with_checkpoint(state, manifest)
            _accept_changes(changes, state, path, run_dir, main)  # refused: nothing loaded or written
            step, data_state, source, notes = load_rank_state(state, path, manifest, layout, coords,
                                                              fresh=changes.only_config,
                                                              reset=frozenset(changes.optimizer))
        else:
            _, saved = load_checkpoint(path, layout=layout, coords=coords)
            step, data_state, source, notes = state.load_state_dict(saved), saved["data"], None, []
        data.train.load_state_dict(data_state)
    except (RuntimeError, KeyError, ValueError) as exc:  # shapes or keys of another model
        raise load_error(path, exc, run_dir) from None
    if main:
        saved = manifest["layout"]
        moved = "" if all(saved.get(k) == layout.get(k) for k in LAYOUT_SHOWN) else (
            f"; resharded from ({layout_text(saved)}) to ({layout_text(layout)})")
        print(f"[k3train] resumed from {path} (step {step}){moved}")
        for note in notes:
            print(f"[k3train] note: {note}")
        if not recorded and source is not None and source != data_source(state.cfg):  # an older checkpoint
            print(f"[k3train] WARNING: {path} was trained on {source}; this run reads {data_source(state.cfg)}. "
                  f"The optimizer, schedule and data position continue from step {step}; to start them "
                  f"fresh on the new data, use train.init_from={path} in a new run directory")
    return step


def init_from(state, spec: str, main: bool) -> None:
    """``train.init_from``: the weights of checkpoint ``spec`` (a run, checkpoints/ or step
    directory of any layout, or a Hugging Face directory from ``export-hf``) into
    ``state``'s model part; nothing else is taken."""
    spec_path = Path(spec)
    if (spec_path / HF_INDEX).is_file():
        _init_from_hf(state, spec_path, main)
        return
    path = resolve_checkpoint(spec_path)
    manifest = open_checkpoint(path, what=f"use it as train.init_from={spec}")
    load_weights_into(state.model, path, manifest, state.info.tp, state.parallel.tp_rank, state.optimizer)
    if main:
        print(f"[k3train] fine-tuning: weights from {path} (step {manifest['step']}, layout "
              f"{layout_text(manifest['layout'])}); fresh optimizer, lr schedule and data position")


def _init_from_hf(state, hf_dir: Path, main: bool) -> None:
    """Every rank reads the HF directory and copies its own part. Its config.json must describe
    this run's model."""
    model_cfg, tensors = load_hf(hf_dir, state.cfg)
    theirs = merge_model_config(state.cfg, model_cfg)
    if (theirs.model, theirs.moe) != (state.cfg.model, state.cfg.moe):
        mine, other = state.cfg.model_dump(), theirs.model_dump()
        diff = [f"{sec}.{k}: {other[sec][k]!r} there, {mine[sec][k]!r} here" for sec in ("model", "moe")
                for k in mine[sec] if mine[sec][k] != other[sec][k]]
        raise UsageError(f"train.init_from={hf_dir}: its config.json describes another model ({'; '.join(diff[:3])}); "
                         f"`k3train import {hf_dir} --out RUN_DIR` writes its config.yaml to start from")
    load_weights_from_tensors(state.model, tensors, state.info.tp, state.parallel.tp_rank, str(hf_dir),
                              state.optimizer)
    if main:
        print(f"[k3train] fine-tuning: weights from the Hugging Face directory {hf_dir}; fresh optimizer, "
              f"lr schedule and data position")
