"""Read a Hugging Face directory written by ``export-hf`` back into our names.

``load_hf(dir)`` -> (model config dict ``{"model": ..., "moe": ..., "data": {"tokenizer": ...}}``,
which ``merge_model_config`` puts into any run config, and the full one-process
state dict in our names, ready for ``build_model(cfg).load_state_dict``). MXFP4-packed experts
(``NAME.mx_codes`` + ``NAME.mx_scales``, uint8) are dequantised to ``quantization_config``'s dtype.

Everything is validated before it is returned (one ``CheckpointError`` line naming the file,
field or tensor): config.json and the index are UTF-8 JSON objects; every ``weight_map`` path
stays inside the directory (no ``..``, no absolute path, no symlink leading out); every tensor
has exactly the dtype ``torch_dtype`` declares (packed experts: uint8, dequantised to
``quantization_config.dequantized_dtype``) and only finite values; the HF-style fields agree
with the ``k3train`` section; the tokenizer (``tokenizer_config.json`` and the file it names)
is present, loadable, unchanged (its hash) and fits the vocabulary.

This module only translates the format (tensor names, safetensors, config.json); it sits below
the trainer. ``k3train.trainer.hf_import.import_hf`` writes what it reads as a run directory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open

from k3train.config import RunConfig
from k3train.data.tokenizer import load_tokenizer
from k3train.errors import CheckpointError
from k3train.hf.export import hf_config
from k3train.hf.names import from_hf
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.model.model import build_model, moe_layer_indices
from k3train.quant.mx import dequantize_mx, unpack_fp4
from k3train.runtime.one_process import process_groups

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The dtypes a tensor of an HF directory may be stored in (``torch_dtype``, and
# ``quantization_config.dequantized_dtype``): what export writes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_json(path: Path) -> dict:
    """A JSON object file, or one line saying why not (missing, not UTF-8, not JSON, not an object)."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a Hugging Face directory from 'k3train export-hf' "
                              f"holds config.json, {INDEX} and its shards")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {exc.start}); expected a JSON object") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def confined(hf_dir: Path, fname, what: str) -> Path:
    """``hf_dir / fname`` where ``fname`` is a relative path that stays inside ``hf_dir`` (no
    ``..``, not absolute, no symlink leading out) and names a regular file; else one line."""
    if not isinstance(fname, str) or not fname:
        raise CheckpointError(f"{what} is {fname!r}, expected a file name inside {hf_dir}")
    rel = Path(fname)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointError(f"{what} is {fname!r}, which leads out of {hf_dir}: only file names inside "
                              f"the directory are read")
    path = hf_dir / rel
    root = hf_dir.resolve()
    if path.exists() and root not in path.resolve().parents:
        raise CheckpointError(f"{what} is {fname!r}, a link leading out of {hf_dir} (to {path.resolve()}): "
                              f"only files inside the directory are read")
    return path


def read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor the index names, each read from the shard the index says holds it."""
    if (hf_dir / INDEX).is_file():
        weight_map = _read_json(hf_dir / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{hf_dir / INDEX} has no 'weight_map' of tensor names to shard files")
        where = f"{INDEX}'s weight_map entry"
    elif (hf_dir / SINGLE).is_file():
        confined(hf_dir, SINGLE, SINGLE)
        with safe_open(str(hf_dir / SINGLE), "pt") as f:
            weight_map = {k: SINGLE for k in f.keys()}
        where = "file"
    else:
        raise CheckpointError(f"{hf_dir} has neither {INDEX} nor {SINGLE}")
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        confined(hf_dir, fname, f"{where} {name!r}")
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
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json: quantization_config is a {type(q).__name__}, expected an object")
    elem, block = q.get("element_format", "e2m1"), q.get("block_size", 32)
    if not (isinstance(block, int) and block >= 1):
        raise CheckpointError(f"config.json: quantization_config.block_size is {block!r}, expected a positive integer")
    name = q.get("dequantized_dtype", "float32")
    if name not in DTYPES:
        raise CheckpointError(f"config.json: quantization_config.dequantized_dtype is {name!r}; allowed: "
                              f"{', '.join(DTYPES)}")
    dtype = DTYPES[name]
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
    for key in ("model", "moe", "data"):
        if key in section and not isinstance(section[key], dict):
            raise CheckpointError(f"{path}: k3train.{key} is a {type(section[key]).__name__}, expected an object")
    return {"model": section["model"], "moe": section.get("moe", {}),
            "data": {"tokenizer": section.get("data", {}).get("tokenizer", "byte")}}


def _config_error(exc: ValidationError, path: Path) -> CheckpointError:
    """pydantic's first complaint as one line naming the field of the ``k3train`` section."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "<section>"
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    if first["type"] == "extra_forbidden":
        return CheckpointError(f"{path}: its k3train model config is invalid: k3train.{field} is not a config key")
    return CheckpointError(f"{path}: its k3train model config is invalid: k3train.{field}: "
                           f"{first['msg'].removeprefix('Value error, ')}{shown}")


def _check_hf_fields(config: dict, cfg: RunConfig, path: Path) -> None:
    """Every HF-style field config.json holds must be what its ``k3train`` section gives (the
    fields export writes from it): a contradiction means an edited or foreign file."""
    ours = json.loads(json.dumps(hf_config(cfg, str(config.get("torch_dtype")))))
    for key, want in ours.items():
        if key in ("k3train", "torch_dtype") or key not in config:
            continue
        if config[key] != want:
            raise CheckpointError(f"{path}: {key} is {config[key]!r}, but its k3train section gives {want!r}; "
                                  f"the HF fields and the k3train section must describe the same model")


def _check_dtypes(tensors: dict, dtype: torch.dtype, path: Path) -> None:
    """Every tensor (HF names) but the packed experts' codes and scales has exactly ``dtype``."""
    for name, t in tensors.items():
        if not name.endswith((".mx_codes", ".mx_scales")) and t.dtype != dtype:
            raise CheckpointError(f"{path}: tensor {name} is {str(t.dtype).removeprefix('torch.')}, but "
                                  f"torch_dtype declares {str(dtype).removeprefix('torch.')}; nothing is cast "
                                  f"on import (re-export with --dtype)")


def _check_finite(state: dict, path: Path) -> None:
    """Only finite values (a flipped exponent bit or a NaN is damage, not a weight)."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{path.parent}: tensor {name} holds {bad} non-finite value(s) (inf or NaN); "
                                  f"a damaged export cannot be imported")


def hf_tokenizer(hf_dir: Path, section_spec, vocab_size: int):
    """(the tokenizer the directory carries (None for the byte tokenizer or an export without
    tokenizer_config.json whose section names none), its file inside ``hf_dir`` (None for the
    byte tokenizer)). Checks it is present, loads, is the one exported (its hash) and fits the
    model's ``vocab_size``."""
    tc_path = hf_dir / TOKENIZER_CONFIG
    if not tc_path.is_file():
        if section_spec in (None, "byte"):
            return None, None
        raise CheckpointError(f"{hf_dir} has no {TOKENIZER_CONFIG}, but config.json's k3train.data.tokenizer "
                              f"names {section_spec!r}: the directory must carry its tokenizer")
    tc = _read_json(tc_path)
    # k3train_tokenizer_file since exports carry a tokenizer.json for transformers (which reads a
    # plain tokenizer_file as its own path); tokenizer_file in earlier exports.
    key = "k3train_tokenizer_file" if "k3train_tokenizer_file" in tc else "tokenizer_file"
    kind = tc.get("k3train_tokenizer_kind", "byte" if key not in tc else None)
    if kind == "byte":
        tok, file = load_tokenizer("byte"), None
    else:
        file = confined(hf_dir, tc.get(key), f"{TOKENIZER_CONFIG}'s {key}")
        if not file.is_file():
            raise CheckpointError(f"tokenizer file {file} named by {tc_path} is missing")
        try:
            tok = load_tokenizer(file)
        except Exception as exc:  # noqa: BLE001 - any reader's error is a damaged file here
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise CheckpointError(f"tokenizer file {file} cannot be loaded ({first})") from None
    want = tc.get("k3train_tokenizer_hash")
    if want is not None and want != tok.files_hash:
        raise CheckpointError(f"{tc_path}: k3train_tokenizer_hash is {want!r}, but the tokenizer it names hashes "
                              f"to {tok.files_hash!r}: the tokenizer was changed after the export")
    if tok.vocab_size > vocab_size:
        raise CheckpointError(f"{tc_path}: the tokenizer has {tok.vocab_size} ids, more than the model's "
                              f"vocab_size {vocab_size}")
    return tok, file


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
    config_path = hf_dir / "config.json"
    config = _read_json(config_path)
    model_cfg = _model_cfg(config, config_path)
    try:
        cfg = merge_model_config(base or RunConfig(), model_cfg)
    except ValidationError as exc:
        raise _config_error(exc, config_path) from None
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: its k3train model config is invalid: "
                              f"{str(exc).splitlines()[0]}") from None
    declared = config.get("torch_dtype")
    if declared not in DTYPES:
        raise CheckpointError(f"{config_path}: torch_dtype is {declared!r}; allowed: {', '.join(DTYPES)}")
    _check_hf_fields(config, cfg, config_path)
    tok, tok_file = hf_tokenizer(hf_dir, model_cfg["data"]["tokenizer"], cfg.model.vocab_size)
    if tok is not None:  # the directory's own copy, checked above; never a path of another machine
        model_cfg["data"] = {"tokenizer": "byte" if tok_file is None else str(tok_file.resolve())}
    raw = read_tensors(hf_dir)
    # packed experts are uint8 (checked by dequantize_packed), the rest exactly torch_dtype
    _check_dtypes(raw, DTYPES[declared], config_path)
    tensors = dequantize_packed(raw, config)
    expected = expected_state(cfg)
    shapes = {k: v for k, v in expected.items() if v is not None}
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    state = from_hf(tensors, kinds, set(moe_layer_indices(cfg)), cfg.model.tie_embeddings, shapes)
    _check_finite(state, config_path)
    state.update({k: None for k, v in expected.items() if v is None})  # megatron's _extra_state
    return model_cfg, {k: state[k] for k in expected}
