"""``k3train eval``: a checkpoint's loss, perplexity and bits per byte over a dataset's validation split.

The model is built under the layout the config (and its ``parallel.*`` overrides) asks for,
in one process or under torchrun, and takes its weights from a checkpoint of any layout. The
loss is the trainer's own validation loss (``TrainState.evaluate``): the mean over batches of
each batch's mean next-token cross-entropy, so ``--batches train.eval_batches`` reproduces the
``val_loss`` the run logged.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from k3train.config import RunConfig, load_config
from k3train.errors import CheckpointError, UsageError


def bytes_per_token(cfg: RunConfig) -> float | None:
    """Text bytes per token of the run's tokenizer, when fixed: 1 for the byte tokenizer; None
    for a learned tokenizer (bits per byte then needs the text's byte count). The one place
    evaluation asks about the tokenizer."""
    from k3train.trainer.data import run_tokenizer

    # data.tokenizer unset means the dataset's own (byte for the built-in corpora)
    return 1.0 if run_tokenizer(cfg).kind == "byte" else None


def eval_config(checkpoint: Path, config: str | None, overrides: list[str], data: str | None) -> RunConfig:
    """The run config for evaluating ``checkpoint``: ``config`` (default: the config.yaml of
    the checkpoint's run directory), then ``overrides``, then ``--data``."""
    path = Path(config) if config else checkpoint.parent.parent / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"no run config at {path}; pass --config (the YAML the checkpoint was trained with)")
    extra = [*overrides, *([f"data.source={data}"] if data else [])]
    return load_config(path, [*extra, "train.init_from=null"])


def evaluate_checkpoint(checkpoint: str | Path, *, config: str | None = None, overrides: list[str] = (),
                        data: str | None = None, batches: int = 0, progress: bool = True) -> dict:
    """Evaluate; returns {"loss", "perplexity", "bits_per_byte" (or None), "batches", "tokens", "step"}.

    batches: how many validation batches of ``train.micro_batch_size`` windows (0: all of the
    split). Under several data-parallel ranks each takes every dp-th batch (of a multiple of dp)."""
    from k3train.runtime.distributed import init_distributed, shutdown_distributed
    from k3train.ops.kernels import apply as apply_kernels
    from k3train.quant.export import resolve_checkpoint
    from k3train.trainer.checkpoint import verify_checkpoint
    from k3train.trainer.data import build_data
    from k3train.trainer.loop import pick_device
    from k3train.trainer.state import TrainState
    from k3train.trainer.state_io import load_weights

    if batches < 0:
        raise UsageError(f"--batches {batches}: expected 0 (the whole validation split) or a positive count")
    step_dir = resolve_checkpoint(checkpoint)
    cfg = eval_config(step_dir, config, list(overrides), data)
    if batches:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_batches": batches})})
    else:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_batches": 1 << 30})})
    apply_kernels(cfg)
    device = pick_device(cfg.train.device)
    p = cfg.parallel
    owned = not dist.is_initialized()
    info = init_distributed(p.tp, p.pp, p.vpp, p.ep, device)
    try:
        if device == "cuda":
            torch.cuda.set_device(info.local_rank)
        dev = torch.device(device, info.local_rank) if device == "cuda" else torch.device("cpu")
        manifest = verify_checkpoint(step_dir, info.world_size, None)
        if "tensors" not in manifest:
            raise UsageError(f"{step_dir} is a checkpoint of the older per-rank format; resume it once "
                             f"(it is then saved by global name) to evaluate it")
        state = TrainState(cfg, info, dev)
        load_weights(state.model, step_dir, manifest, info.tp, state.parallel.tp_rank)
        from megatron.core import parallel_state

        val = build_data(cfg, parallel_state.get_data_parallel_rank(), info.dp).val
        # Every rank the same count (expert all-to-alls span the data-parallel ranks): a
        # remainder of fewer than dp batches is left out.
        val = val[:len(val) // info.dp * info.dp]
        if not val:
            raise UsageError(f"the validation split has fewer batches than the {info.dp} data-parallel ranks")
        mine = val[parallel_state.get_data_parallel_rank()::info.dp]
        total = torch.zeros(2, dtype=torch.float64)
        bar = tqdm(mine, desc="eval", disable=not (progress and cfg.logging.progress_bar and info.is_main), file=sys.stdout, dynamic_ncols=True)
        for b in bar:
            total += torch.tensor([state.evaluate([b]), 1.0], dtype=torch.float64)
            bar.set_postfix(loss=f"{total[0] / total[1]:.4f}")
        bar.close()
        if info.dp > 1:
            dist.all_reduce(total, group=state.dp_group)
        loss = float(total[0] / total[1])
        bpt = bytes_per_token(cfg)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                "bits_per_byte": loss / math.log(2) / bpt if bpt else None,
                "batches": int(total[1]), "tokens": int(total[1]) * cfg.train.micro_batch_size * cfg.train.seq_len,
                "step": manifest["step"], "checkpoint": str(step_dir), "data": cfg.data.source}
    finally:
        if owned:
            shutdown_distributed()


def format_result(r: dict) -> str:
    bpb = "n/a (learned tokenizer)" if r["bits_per_byte"] is None else f"{r['bits_per_byte']:.4f}"
    return (f"eval {r['checkpoint']} (step {r['step']}) on {r['data']}: {r['batches']} batches, "
            f"{r['tokens']:,} tokens\nloss {r['loss']:.4f} | perplexity {r['perplexity']:.3f} | "
            f"bits per byte {bpb}")
