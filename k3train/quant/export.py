"""``k3train export --format mxfp4-packed``: a training checkpoint -> packed MXFP4 safetensors.

Output directory:
    model.safetensors   for each quantised parameter P: ``P.mx_codes`` uint8, two E2M1 codes per
                        byte (``pack_fp4``: even element in the low nibble) and ``P.mx_scales``
                        uint8 E8M0 bytes (bias 127, 0xFF = NaN), one per 32-element block;
                        every other tensor in bf16 (integer tensors unchanged), under its own name
    export.json         format, element/scale format, block size, and for each quantised P its
                        original shape and dtype, ``block_axis`` and the stored (codes) shape

Blocks run along each weight's reduction axis, the axis the QAT forward blocks along: dim 1 for
nn.Linear / TP-linear ``[out, in]`` weights and for grouped expert weights (``w_gate``/``w_up``
``[E, in, ffn]``, ``w_down`` ``[E, ffn, in]``, used as ``x @ w[e]``). Codes are stored with that
axis moved last (``w.movedim(block_axis, -1)``); ``load_mxfp4_export`` moves it back, so the
loaded weights equal the QAT forward's fake-quantised weights bit for bit.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
from megatron.core import parallel_state
from safetensors.torch import load_file, save_file

from k3train.errors import CheckpointError, UsageError
from k3train.config import RunConfig, load_config
from k3train.config.schema import ParallelConfig, PrecisionConfig
from k3train.quant.mx import dequantize_mx, pack_fp4, quantize_mx, unpack_fp4

FORMAT, ELEM, BLOCK = "mxfp4-packed", "e2m1", 32


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A ``step_XXXXXXXX`` directory, or a ``checkpoints/`` directory whose ``latest`` names one."""
    from k3train.trainer.checkpoint import latest_checkpoint

    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    if (p / "latest").is_file():
        return latest_checkpoint(p)
    raise CheckpointError(f"{p} is neither a checkpoint step directory (no manifest.json) nor a "
                            f"checkpoints/ directory (no 'latest' file)")


@contextlib.contextmanager
def _model_parallel_groups():
    """Building layers needs megatron's groups; create one-process groups only if absent."""
    from k3train.runtime.distributed import init_distributed, shutdown_distributed

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    init_distributed()
    try:
        yield
    finally:
        shutdown_distributed()


def quantized_params(cfg: RunConfig) -> dict[str, int]:
    """{state-dict name: block axis} for the parameters the mxfp4_qat scope of ``cfg`` covers.

    Found by building the model with the same scope selection the trainer uses, on the meta
    device (no memory, no init cost), so export and training can never disagree on the scope.
    """
    from k3train.model.model import build_model
    from moe import GroupedExperts

    if cfg.precision.recipe not in ("mxfp4_qat", "bf16", "fp32"):
        raise UsageError(f"mxfp4-packed export needs a checkpoint trained with precision.recipe=mxfp4_qat "
                         f"(or bf16/fp32, quantised after training); this one used {cfg.precision.recipe}")
    precision = PrecisionConfig(recipe="mxfp4_qat", scope=cfg.precision.scope)
    # The one-process model: export works on the consolidated tensors whatever layout trained them.
    cfg = cfg.model_copy(update={"precision": precision, "parallel": ParallelConfig(),
                                 "train": cfg.train.model_copy(update={"device": "cpu"})})
    with _model_parallel_groups(), torch.device("meta"):
        model = build_model(cfg)
    out: dict[str, int] = {}
    for name in model.quantized:
        mod = model.get_submodule(name)
        if isinstance(mod, GroupedExperts):
            out.update({f"{name}.{w}": 1 for w in ("w_gate", "w_up", "w_down")})
        elif hasattr(mod, "inner"):  # ColumnLinear / RowLinear hold megatron's layer
            out[f"{name}.inner.weight"] = 1
        else:
            out[f"{name}.weight"] = 1
    return out


def read_checkpoint_weights(checkpoint: str | os.PathLike, config: str | os.PathLike | None = None,
                            ) -> tuple[dict, RunConfig, Path, Path]:
    """(the one-process model's state dict, run config, step dir, config path) of a checkpoint of
    any parallel layout (its pieces assembled by global name); the config defaults to the run
    directory's config.yaml."""
    from k3train.trainer.state_io import consolidated_state

    step_dir = resolve_checkpoint(checkpoint)
    whole = consolidated_state(step_dir, optimizer=False)
    cfg_path = Path(config) if config is not None else step_dir.parent.parent / "config.yaml"
    if not cfg_path.is_file():
        raise CheckpointError(f"no run config at {cfg_path}; pass --config")
    return whole["model"], load_config(cfg_path), step_dir, cfg_path


def export_mxfp4(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                 config: str | os.PathLike | None = None) -> Path:
    """Write ``out_dir`` (atomically: temp dir + rename) from a checkpoint of any parallel
    layout (its pieces are assembled into the one-process model's tensors)."""
    state, cfg, step_dir, cfg_path = read_checkpoint_weights(checkpoint, config)
    axes = quantized_params(cfg)
    missing = sorted(set(axes) - set(state))
    if missing:
        raise UsageError(f"checkpoint {step_dir} lacks {missing[:3]}: does {cfg_path} describe this model?")

    tensors, entries = {}, {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):  # megatron layers store a None _extra_state
            continue
        value = value.detach()
        if name in axes:
            axis = axes[name]
            moved = value.movedim(axis, -1).contiguous()
            codes, scales = quantize_mx(moved, ELEM, BLOCK)
            tensors[f"{name}.mx_codes"] = pack_fp4(codes).contiguous()
            tensors[f"{name}.mx_scales"] = scales.contiguous()
            entries[name] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                             "block_axis": axis, "stored_shape": list(moved.shape)}
        else:
            # clone: safetensors refuses tensors sharing storage (a tied head and embedding).
            cast = value.to(torch.bfloat16) if value.is_floating_point() else value
            tensors[name] = cast.clone().contiguous()

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
    meta = {"format": FORMAT, "element_format": ELEM, "scale_format": "e8m0", "block_size": BLOCK,
            "nibble_order": "element 2k in the low nibble of byte k", "source": str(step_dir),
            "step": json.loads((step_dir / "manifest.json").read_text())["step"],
            "trained_recipe": cfg.precision.recipe, "quantized": entries}
    (tmp / "export.json").write_text(json.dumps(meta, indent=1))
    replace_dir(tmp, out)
    return out


def replace_dir(tmp: Path, out: Path) -> None:
    """Make the finished ``tmp`` directory ``out``: its files synced, then swapped in by renames,
    so a reader sees the old export or the new one, never half of either."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = out.parent / f".old-{out.name}"
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def load_mxfp4_export(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read an export: {name: tensor}, quantised parameters dequantised to their original dtype
    and shape (equal to the QAT forward's fake-quantised weights), others as stored (bf16)."""
    path = Path(path)
    meta = json.loads((path / "export.json").read_text())
    if meta.get("format") != FORMAT:
        raise UsageError(f"{path} holds format {meta.get('format')!r}, expected {FORMAT!r}")
    raw = load_file(str(path / "model.safetensors"))
    out = {k: v for k, v in raw.items() if not k.endswith((".mx_codes", ".mx_scales"))}
    for name, e in meta["quantized"].items():
        codes = unpack_fp4(raw[f"{name}.mx_codes"])
        w = dequantize_mx(codes, raw[f"{name}.mx_scales"], meta["element_format"], meta["block_size"],
                          getattr(torch, e["dtype"]))
        out[name] = w.movedim(-1, e["block_axis"]).contiguous()
    return out
