"""``k3train export-hf``: a full state dict + RunConfig -> a Hugging Face directory.

Output directory (written atomically: temp dir + rename):
    config.json                     HF-style fields (``architectures``, ``model_type``, sizes) and
                                    a ``k3train`` section holding our model/moe config, from which
                                    ``load_hf`` rebuilds the exact model
    model-0000K-of-0000N.safetensors  the tensors in HF names (k3train/hf/names.py), sharded so no
                                    shard exceeds ``shard_bytes`` (a bigger tensor gets its own)
    model.safetensors.index.json    ``metadata.total_size`` and ``weight_map`` {tensor: shard}
    tokenizer_config.json           which tokenizer the model was trained with, as
                                    ``transformers.AutoTokenizer`` reads it (``hf/tokenizer.py``)
    tokenizer.json                  the byte or tiktoken tokenizer as a ``tokenizers`` model, or
                                    a ``tokenizers`` one's own file (any file tokenizer's files
                                    are copied too)
    configuration_k3train.py,       the model for ``transformers`` (``trust_remote_code``; copied
    modeling_k3train.py             from ``k3train/hf/remote_code/``; ``auto_map`` in config.json;
                                    not with ``mxfp4``, whose packed experts transformers cannot read)

With ``mxfp4=True`` every routed expert weight ``[out, in]`` is stored as ``NAME.mx_codes``
(uint8, two E2M1 codes per byte, element 2k in the low nibble) and ``NAME.mx_scales`` (uint8
E8M0, one per 32 elements along ``in``, the reduction axis), as ``k3train.quant.export`` does;
``config.json`` then carries a ``quantization_config``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe.activations import DEFAULT_BETA, DEFAULT_BETA_LIN

from k3train.config import RunConfig
from k3train.data.tokenizer import ByteTokenizer, load_tokenizer
from k3train.errors import UsageError
from k3train.hf.kimi_linear import kimi_linear_misfits
from k3train.hf.names import to_hf
from k3train.hf.tokenizer import write_tokenizer
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.model.model import moe_layer_indices
from k3train.quant.mx import pack_fp4, quantize_mx
from k3train.runtime.files import default_file_mode, output_dir

ARCHITECTURE, MODEL_TYPE = "K3ForCausalLM", "k3train_k3"
MX_ELEM, MX_BLOCK = "e2m1", 32
EXPERT_RE = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.\w+\.weight$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = ("k3train", "kimi_linear")
REMOTE_CODE = Path(__file__).parent / "remote_code"
REMOTE_FILES = ("configuration_k3train.py", "modeling_k3train.py")
AUTO_MAP = {"AutoConfig": "configuration_k3train.K3Config",
            "AutoModel": "modeling_k3train.K3Model",
            "AutoModelForCausalLM": "modeling_k3train.K3ForCausalLM"}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KiB' or a byte count -> bytes (decimal units, binary with 'i')."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UsageError(f"--shard-size {text!r} is not a size; use e.g. 5GB, 500MB, 2GiB or a byte count")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    size = int(float(m.group(1)) * base ** power)
    if size < 1:
        raise UsageError(f"--shard-size {text!r} must be at least 1 byte")
    return size


def hf_config(cfg: RunConfig, dtype: str) -> dict:
    """config.json: the HF-style description, plus ``k3train`` (what rebuilds the model)."""
    m, moe = cfg.model, cfg.moe
    kinds = expand_layer_pattern(m.layer_pattern, m.num_layers)
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "torch_dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "intermediate_size": m.ffn.intermediate_size, "hidden_act": "situ",
        "first_k_dense_replace": m.dense_layers,
        "num_attention_heads": m.mla.num_heads, "q_lora_rank": m.mla.q_lora_rank,
        "kv_lora_rank": m.mla.kv_lora_rank, "qk_nope_head_dim": m.mla.qk_nope_head_dim,
        "qk_rope_head_dim": m.mla.qk_rope_head_dim, "v_head_dim": m.mla.v_head_dim,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
        "moe_intermediate_size": moe.expert_ffn_size, "n_shared_experts": moe.num_shared_experts,
        "moe_latent_size": moe.latent_size, "scoring_func": "sigmoid",
        # Kimi Linear's convention: 1-based layer numbers of each kind.
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "K"],
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "M"],
            "num_heads": m.kda.num_heads, "head_dim": m.kda.head_dim,
            "short_conv_kernel_size": m.kda.conv_size, "gate_lower_bound": m.kda.gate_lower_bound,
        },
        "attn_res": {"enabled": m.attnres.enabled, "block_size": m.attnres.block_size},
        # The SiTU betas: the dense FFN's from the config; LatentMoE's experts use moe's defaults.
        "situ": {"ffn_beta": m.ffn.situ_beta, "ffn_beta_lin": m.ffn.situ_beta_lin,
                 "expert_beta": DEFAULT_BETA, "expert_beta_lin": DEFAULT_BETA_LIN},
        "auto_map": AUTO_MAP,
        "k3train": {"model": m.model_dump(mode="json"), "moe": moe.model_dump(mode="json"),
                    "data": {"tokenizer": cfg.data.tokenizer}},
    }


def _quantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in tensors.items():
        if not EXPERT_RE.match(name):
            out[name] = w
            continue
        if w.shape[-1] % MX_BLOCK:
            raise UsageError(f"--mxfp4 needs every expert's input size divisible by {MX_BLOCK}; {name} "
                             f"has shape {list(w.shape)}")
        codes, scales = quantize_mx(w.float(), MX_ELEM, MX_BLOCK)
        out[f"{name}.mx_codes"], out[f"{name}.mx_scales"] = pack_fp4(codes).contiguous(), scales.contiguous()
    return out


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Greedy in name order: a shard closes when the next tensor would push it past ``limit``."""
    shards, size = [{}], 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def export_hf(state: dict, cfg: RunConfig, out_dir: str | os.PathLike, *, shard_bytes: int = 5 * 10**9,
              dtype: str | None = None, mxfp4: bool = False, tokenizer=None, overwrite: bool = False,
              layout: str = "k3train", log=print) -> Path:
    """Write ``out_dir`` from our full (one-process) model state dict ``state`` and its config.

    dtype: None keeps every tensor's dtype (bitwise round trip), or "bfloat16"/"float32" for the
    floating-point tensors. tokenizer: the run's tokenizer (``k3train.trainer.data.run_tokenizer``
    resolves it; default: ``data.tokenizer``, else the byte tokenizer). overwrite: replace a
    previous HF export in ``out_dir`` (never a run directory or another directory: see
    ``k3train.runtime.files.output_dir``). layout: ``"k3train"`` (our names, loaded by
    transformers through the remote code written beside them) or ``"kimi_linear"``
    (transformers' own class: refused, naming each misfit, for a model that does not fit it;
    ``k3train.hf.kimi_linear``). Returns the directory.
    """
    if layout not in LAYOUTS:
        raise UsageError(f"--layout {layout!r} is not a layout; allowed: {', '.join(LAYOUTS)}")
    if layout == "kimi_linear":
        misfits = kimi_linear_misfits(cfg)
        # Every model k3train builds has a misfit (k3train.hf.kimi_linear says why): no writer here.
        raise UsageError("export-hf --layout kimi_linear: this model does not fit transformers' kimi_linear: "
                         + "; ".join(misfits) + "; the default --layout k3train loads in transformers with "
                         "trust_remote_code=True")
    if dtype is not None and dtype not in _DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not supported; allowed: {', '.join(_DTYPES)}")
    if cfg.model.kda.gate != "channel":
        raise UsageError(f"model.kda.gate={cfg.model.kda.gate!r} (one decay per head) has no counterpart in the "
                         "Hugging Face format, whose KDA layers have a per-channel gate; the run's own checkpoints keep it")
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    try:
        tensors = to_hf(state, kinds, set(moe_layer_indices(cfg)), cfg.model.tie_embeddings)
    except KeyError as exc:
        raise UsageError(f"the checkpoint does not match its config: {exc.args[0]}") from None
    if dtype is not None:
        tensors = {k: v.to(_DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
    stored = dtype or str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = hf_config(cfg, stored)
    if mxfp4:
        expert_dtype = next(str(v.dtype).removeprefix("torch.") for k, v in tensors.items() if EXPERT_RE.match(k))
        tensors = _quantize(tensors)
        config["quantization_config"] = {
            "quant_method": "mxfp4", "element_format": MX_ELEM, "scale_format": "e8m0",
            "block_size": MX_BLOCK, "nibble_order": "element 2k in the low nibble of byte k",
            "modules": "model.layers.*.mlp.experts.*", "suffixes": [".mx_codes", ".mx_scales"],
            "dequantized_dtype": expert_dtype}
        # transformers cannot read packed experts: such a directory is for ``k3train import``.
        del config["auto_map"]

    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else ByteTokenizer()
    out = Path(out_dir)
    with output_dir(out, command="export-hf", overwrite=overwrite) as tmp:
        shards = _shards(tensors, shard_bytes)
        mode = default_file_mode()
        weight_map, total = {}, 0
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            # clone: safetensors refuses tensors that share storage (views of one expert stack)
            save_file({n: t.clone() for n, t in shard.items()}, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, mode)  # safetensors writes 0600; shards are shared like the JSON files
            weight_map.update({n: fname for n in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
            log(f"[k3train] wrote shard {k}/{len(shards)} ({fname}, {len(shard)} tensors)")
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        if "auto_map" in config:
            for name in REMOTE_FILES:
                shutil.copyfile(REMOTE_CODE / name, tmp / name)
        write_tokenizer(tokenizer, tmp)
    return out

