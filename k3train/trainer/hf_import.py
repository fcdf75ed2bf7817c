"""``k3train import``: a Hugging Face directory (from ``export-hf``) -> a run directory
holding ``config.yaml`` and a weights-only checkpoint ``checkpoints/step_00000000`` in the
trainer's own format, which ``train.init_from``, ``eval``, ``generate`` and ``export`` read.

The directory is written into a temporary sibling and renamed into place
(``k3train.runtime.files.output_dir``): an existing target is replaced only when it is a
previous import (its ``k3train_output.json`` says so, no run has trained in it) and
``overwrite`` is given.

Nothing is written before ``load_hf`` has validated the directory (dtypes, finite values, paths
confined to it, HF fields against the ``k3train`` section, the tokenizer). A tokenizer with
files is copied into ``out_dir/tokenizer/`` and ``data.tokenizer`` names that copy: the run
directory then needs neither the HF directory nor the exporting machine's paths.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from k3train.config import load_config
from k3train.trainer.run_dir import save_config
from k3train.errors import CheckpointError
from k3train.hf.load import load_hf, merge_model_config
from k3train.model.model import build_model
from k3train.runtime.files import output_dir
from k3train.runtime.one_process import process_groups
from k3train.trainer.checkpoint import save_checkpoint
from k3train.trainer.state_io import weights_state


def import_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike,
              config: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
    """Write ``out_dir/config.yaml`` (``config`` or the defaults, with the HF model's model/moe/
    tokenizer) and the weights-only checkpoint ``out_dir/checkpoints/step_00000000``; returns
    the step directory. Nothing is written when the HF directory does not hold its model."""
    base = load_config(config)
    model_cfg, state = load_hf(hf_dir, base)
    out = Path(os.path.abspath(out_dir))
    tok_file = _tokenizer_file(Path(hf_dir), model_cfg["data"].get("tokenizer"))
    if tok_file is not None:  # load_hf checked it loads; the run reads its own copy
        model_cfg["data"] = {"tokenizer": str(out / "tokenizer" / tok_file.name)}
    cfg = merge_model_config(base, model_cfg)
    with process_groups() as info, output_dir(out, command="import", overwrite=overwrite,
                                             details={"source": str(Path(hf_dir).resolve())}) as tmp:
        model = build_model(cfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in [*missing, *unexpected] if not k.endswith("_extra_state")]
        if bad:
            raise CheckpointError(f"{hf_dir} does not hold the model its config.json describes "
                                  f"(e.g. {sorted(bad)[:3]})")
        # the trainer's checkpoint format (tensors by global name), read like any other
        content, index = weights_state(model, 0, str(Path(hf_dir).resolve()))
        layout = {**info.__dict__, "zero1": cfg.optim.zero1}
        coords = {"pp": 0, "tp": 0, "ep": 0, "dp": 0}
        if tok_file is not None:
            (tmp / "tokenizer").mkdir()
            shutil.copyfile(tok_file, tmp / "tokenizer" / tok_file.name)
        save_config(cfg, tmp / "config.yaml")
        save_checkpoint(tmp / "checkpoints", 0, content, layout=layout, coords=coords, index=index)
    return out / "checkpoints" / "step_00000000"


def _tokenizer_file(hf_dir: Path, spec: str | None) -> Path | None:
    """The tokenizer file ``load_hf`` resolved inside ``hf_dir`` (None: the byte tokenizer)."""
    if spec in (None, "byte"):
        return None
    path = Path(spec)
    return path if hf_dir.resolve() in path.resolve().parents else None
