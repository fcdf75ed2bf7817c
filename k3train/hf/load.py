"""Read a Hugging Face directory written by ``export-hf`` back into our names.

``load_hf(dir)`` -> (model config dict ``{"model": ..., "moe": ..., "data": {"tokenizer": ...}}``,
which ``merge_model_config`` puts into any run config, and the full one-process
state dict in our names, ready for ``build_model(cfg).load_state_dict``). MXFP4-packed experts
(``NAME.mx_codes`` + ``NAME.mx_scales``, uint8) are dequantised to ``quantization_config``'s dtype.

This module only translates the format (tensor names, safetensors, config.json); it sits below
the trainer. ``k3train.trainer.hf_import.import_hf`` writes what it reads as a run directory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from k3train.config import RunConfig
from k3train.errors import CheckpointError
from k3train.hf.names import from_hf
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.model.model import build_model, moe_layer_indices
from k3train.quant.mx import dequantize_mx, unpack_fp4
from k3train.runtime.one_process import process_groups

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a Hugging Face directory from 'k3train export-hf' "
                              f"holds config.json, {INDEX} and its shards")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor the index names, each read from the shard the index says holds it."""
    if (hf_dir / INDEX).is_file():
        weight_map = _read_json(hf_dir / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{hf_dir / INDEX} has no 'weight_map' of tensor names to shard files")
    elif (hf_dir / SINGLE).is_file():
        with safe_open(str(hf_dir / SINGLE), "pt") as f:
            weight_map = {k: SINGLE for k in f.keys()}
    else:
        raise CheckpointError(f"{hf_dir} has neither {INDEX} nor {SINGLE}")
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
    out = {}
    for fname, names in sorted(by_file.items()):
        path = hf_dir / fname
        if not path.is_file():
            raise CheckpointError(f"shard {path} named by {INDEX} (for {names[0]} and {len(names) - 1} more) "
                                  f"is missing")
        try:
            with safe_open(str(path), "pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{INDEX} puts tensor {name} in {path}, which does not hold it")
                    out[name] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise CheckpointError(f"shard {path} cannot be read: {exc}") from None
    return out


def dequantize_packed(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Replace each ``NAME.mx_codes``/``NAME.mx_scales`` pair by ``NAME`` ``[out, in]``."""
    codes_names = [k for k in tensors if k.endswith(".mx_codes")]
    if not codes_names:
        return tensors
    q = config.get("quantization_config") or {}
    elem, block = q.get("element_format", "e2m1"), int(q.get("block_size", 32))
    dtype = getattr(torch, q.get("dequantized_dtype", "float32"))
    out = {k: v for k, v in tensors.items() if not k.endswith((".mx_codes", ".mx_scales"))}
    for cname in codes_names:
        name = cname.removesuffix(".mx_codes")
        sname = name + ".mx_scales"
        if sname not in tensors:
            raise CheckpointError(f"packed tensor {cname} has no {sname} beside it")
        codes, scales = tensors[cname], tensors[sname]
        if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise CheckpointError(f"packed tensor {name} must be uint8 codes and scales, found "
                                  f"{codes.dtype} and {scales.dtype}")
        try:
            out[name] = dequantize_mx(unpack_fp4(codes), scales, elem, block, dtype)
        except ValueError as exc:
            raise CheckpointError(f"packed tensor {name}: {exc}") from None
    return out


def _model_cfg(config: dict, path: Path) -> dict:
    section = config.get("k3train")
    if not isinstance(section, dict) or "model" not in section:
        raise CheckpointError(f"{path} has no 'k3train' section with the model config; only directories "
                              f"written by 'k3train export-hf' can be imported today")
    return {"model": section["model"], "moe": section.get("moe", {}),
            "data": {"tokenizer": section.get("data", {}).get("tokenizer", "byte")}}


def merge_model_config(base: RunConfig, model_cfg: dict) -> RunConfig:
    """``base`` with ``load_hf``'s model and moe sections and its tokenizer."""
    tree = base.model_dump(mode="json")
    tree.update({"model": model_cfg["model"], "moe": model_cfg["moe"]})
    tree["data"] = {**tree["data"], **model_cfg.get("data", {})}
    return RunConfig.model_validate(tree)


def expected_state(cfg: RunConfig) -> dict:
    """Our state dict's entries for ``cfg``: shapes of tensors, None for megatron's extra state.
    Built on the meta device: no memory, no init."""
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": "cpu"}),
                                 "precision": cfg.precision.model_copy(update={"recipe": "fp32"})})
    with process_groups(reuse_existing=True), torch.device("meta"):
        model = build_model(cfg)
    return {k: (v.shape if isinstance(v, torch.Tensor) else v) for k, v in model.state_dict().items()}


def load_hf(hf_dir: str | os.PathLike, base: RunConfig | None = None) -> tuple[dict, dict]:
    """(model config dict, full state dict in our names) of an HF directory; see the module doc."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} is not a directory")
    config = _read_json(hf_dir / "config.json")
    model_cfg = _model_cfg(config, hf_dir / "config.json")
    try:
        cfg = merge_model_config(base or RunConfig(), model_cfg)
    except ValueError as exc:
        raise CheckpointError(f"{hf_dir / 'config.json'}: its k3train model config is invalid: "
                              f"{str(exc).splitlines()[0]}") from None
    tensors = dequantize_packed(read_tensors(hf_dir), config)
    expected = expected_state(cfg)
    shapes = {k: v for k, v in expected.items() if v is not None}
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    state = from_hf(tensors, kinds, set(moe_layer_indices(cfg)), cfg.model.tie_embeddings, shapes)
    state.update({k: None for k, v in expected.items() if v is None})  # megatron's _extra_state
    return model_cfg, {k: state[k] for k in expected}
