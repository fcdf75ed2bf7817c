"""``k3train export``: a checkpoint of any parallel layout -> packed MXFP4 safetensors
(``k3train.quant.export``'s format) or a Hugging Face directory (``k3train.hf.export``).

The checkpoint is opened by ``k3train.trainer.restore`` (a run, checkpoints/ or step directory;
pieces assembled by global name). The output directory is written into a temporary sibling and
renamed into place; an existing one is replaced only when it is a previous output of the same
export format and ``overwrite`` is given (``k3train.runtime.files.output_dir``).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from k3train.config import RunConfig
from k3train.config.schema import ParallelConfig, PrecisionConfig
from k3train.errors import DataError, UsageError
from k3train.hf.export import export_hf
from k3train.quant.export import FORMAT as MXFP4_FORMAT, pack_mxfp4, write_mxfp4
from k3train.model.model import build_model
from k3train.runtime.files import output_dir
from k3train.runtime.one_process import process_groups
from k3train.trainer.data import run_tokenizer
from k3train.trainer.restore import read_weights
from moe import GroupedExperts



def quantized_params(cfg: RunConfig) -> dict[str, int]:
    """{state-dict name: block axis} for the parameters the mxfp4_qat scope of ``cfg`` covers.

    Found by building the model with the same scope selection the trainer uses, on the meta
    device (no memory, no init cost), so export and training can never disagree on the scope.
    """
    if cfg.precision.recipe not in ("mxfp4_qat", "bf16", "fp32"):
        raise UsageError(f"mxfp4-packed export needs a checkpoint trained with precision.recipe=mxfp4_qat "
                         f"(or bf16/fp32, quantised after training); this one used {cfg.precision.recipe}")
    precision = PrecisionConfig(recipe="mxfp4_qat", scope=cfg.precision.scope)
    # The one-process model: export works on the consolidated tensors whatever layout trained them.
    cfg = cfg.model_copy(update={"precision": precision, "parallel": ParallelConfig(),
                                 "train": cfg.train.model_copy(update={"device": "cpu"})})
    with process_groups(reuse_existing=True), torch.device("meta"):
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

def export_mxfp4(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                 config: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
    """Write ``out_dir`` (model.safetensors + export.json) from ``checkpoint``; returns it."""
    w = read_weights(checkpoint, config)
    tensors, entries = pack_mxfp4(w.state, quantized_params(w.cfg))
    with output_dir(out_dir, command=f"export-{MXFP4_FORMAT}", overwrite=overwrite) as tmp:
        write_mxfp4(tensors, {"source": str(w.step_dir), "step": w.step, "trained_recipe": w.cfg.precision.recipe,
                              "quantized": entries}, tmp)
    return Path(out_dir)


def export_hf_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                         config: str | os.PathLike | None = None, *, overwrite: bool = False, **kwargs) -> Path:
    """``k3train.hf.export.export_hf`` of ``checkpoint`` with the run's tokenizer (``data.tokenizer``,
    else the one its dataset's meta file records); kwargs: export_hf's shard_bytes, dtype, mxfp4, layout, log."""
    w = read_weights(checkpoint, config)
    try:
        tokenizer = run_tokenizer(w.cfg)
    except DataError as exc:  # the dataset is not on this machine: say so rather than guess
        raise DataError(f"export-hf needs the run's tokenizer: {exc}") from None
    return export_hf(w.state, w.cfg, out_dir, tokenizer=tokenizer, overwrite=overwrite, **kwargs)
