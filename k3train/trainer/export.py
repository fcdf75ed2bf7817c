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

from k3train.errors import DataError
from k3train.hf.export import export_hf
from k3train.quant.export import FORMAT as MXFP4_FORMAT, pack_mxfp4, write_mxfp4
from k3train.runtime.files import output_dir
from k3train.trainer.data import run_tokenizer
from k3train.trainer.restore import read_weights


def export_mxfp4(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                 config: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
    """Write ``out_dir`` (model.safetensors + export.json) from ``checkpoint``; returns it."""
    w = read_weights(checkpoint, config)
    tensors, entries = pack_mxfp4(w.state, w.cfg)
    with output_dir(out_dir, command=f"export-{MXFP4_FORMAT}", overwrite=overwrite) as tmp:
        write_mxfp4(tensors, {"source": str(w.step_dir), "step": w.step, "trained_recipe": w.cfg.precision.recipe,
                              "quantized": entries}, tmp)
    return Path(out_dir)


def export_hf_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                         config: str | os.PathLike | None = None, *, overwrite: bool = False, **kwargs) -> Path:
    """``k3train.hf.export.export_hf`` of ``checkpoint`` with the run's tokenizer (``data.tokenizer``,
    else the one its dataset's meta file records); kwargs: export_hf's shard_bytes, dtype, mxfp4, log."""
    w = read_weights(checkpoint, config)
    try:
        tokenizer = run_tokenizer(w.cfg)
    except DataError as exc:  # the dataset is not on this machine: say so rather than guess
        raise DataError(f"export --format hf needs the run's tokenizer: {exc}") from None
    return export_hf(w.state, w.cfg, out_dir, tokenizer=tokenizer, overwrite=overwrite, **kwargs)
