"""The packed MXFP4 export format: a one-process state dict -> packed MXFP4 safetensors, and back.
(``k3train.trainer.export.export_mxfp4`` writes one from a checkpoint.)

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

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3train.errors import UsageError
from k3train.quant.mx import dequantize_mx, pack_fp4, quantize_mx, unpack_fp4
from k3train.runtime.files import default_file_mode

FORMAT, ELEM, BLOCK = "mxfp4-packed", "e2m1", 32


def pack_mxfp4(state: dict, axes: dict[str, int]) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors to store, ``quantized`` entries of export.json) for the one-process model's
    state dict ``state``: each parameter named in ``axes`` ({name: block axis}, from
    ``k3train.trainer.export.quantized_params``) as packed codes and scales, every other tensor
    in bf16 (integer tensors unchanged). See the module doc for the layout."""
    missing = sorted(set(axes) - set(state))
    if missing:
        raise UsageError(f"the checkpoint lacks {missing[:3]}: does its config describe this model?")
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
    return tensors, entries


def write_mxfp4(tensors: dict[str, torch.Tensor], meta: dict, out: Path) -> None:
    """``out/model.safetensors`` (mode 0666 minus the umask, like the JSON) and ``out/export.json``."""
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": FORMAT})
    os.chmod(out / "model.safetensors", default_file_mode())  # safetensors writes 0600
    (out / "export.json").write_text(json.dumps({"format": FORMAT, "element_format": ELEM, "scale_format": "e8m0",
                                                 "block_size": BLOCK, "nibble_order": "element 2k in the low "
                                                 "nibble of byte k", **meta}, indent=1))


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
