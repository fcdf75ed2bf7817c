"""``k3train eval``: a checkpoint's loss, perplexity and bits per byte over a dataset's validation split.

The model is built under the layout the ``parallel.*`` overrides ask for (in one process: one
process, whatever layout trained the checkpoint; under torchrun: the checkpoint's run config's),
and takes its weights from a checkpoint of any layout (``k3train.trainer.restore``). The
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

from k3train.config import RunConfig
from k3train.errors import UsageError
from k3train.ops.kernels import apply as apply_kernels
from k3train.runtime.device import resolve_device
from k3train.runtime.one_process import process_groups
from k3train.runtime.threads import apply_threads
from k3train.trainer.data import build_data, run_tokenizer
from k3train.trainer.position_loss import PositionLoss, token_losses
from k3train.trainer.restore import load_weights_into, open_checkpoint, resolve_checkpoint, run_config
from k3train.trainer.state import TrainState


def bytes_per_token(cfg: RunConfig) -> float | None:
    """Text bytes per token of the run's tokenizer, when fixed: 1 for the byte tokenizer; None
    for a learned tokenizer (bits per byte then needs the text's byte count). The one place
    evaluation asks about the tokenizer."""
    # data.tokenizer unset means the dataset's own (byte for the built-in corpora)
    return 1.0 if run_tokenizer(cfg).kind == "byte" else None


def evaluate_checkpoint(checkpoint: str | Path, *, config: str | None = None, overrides: list[str] = (),
                        data: str | None = None, batches: int = 0, progress: bool = True,
                        seq_len: int = 0, by_position: bool = False) -> dict:
    """Evaluate; returns {"loss", "perplexity", "bits_per_byte" (or None), "batches", "tokens",
    "step", "checkpoint", "data", "whole_split", "micro_batch_size", "seq_len"}: ``batches`` and
    ``tokens`` count what was evaluated (tokens: the predicted positions, ``seq_len`` per window),
    ``whole_split`` whether that is the whole validation split (``batches`` 0).

    checkpoint: a run directory, its checkpoints/ directory or a step directory, of any layout.
    batches: how many validation batches of ``train.micro_batch_size`` windows (0: all of the
    split). Under several data-parallel ranks each takes every dp-th batch (of a multiple of dp).
    seq_len: evaluate windows of this many tokens (0: the run's ``train.seq_len``).
    by_position: also the loss by position bucket (``k3train.trainer.position_loss``), returned
    as ``by_position`` rows; runs the whole model in one pipeline stage."""
    if batches < 0:
        raise UsageError(f"--batches {batches}: expected 0 (the whole validation split) or a positive count")
    if seq_len < 0:
        raise UsageError(f"--seq-len {seq_len}: expected a positive window length (0: the run's train.seq_len)")
    if seq_len:
        overrides = [*overrides, f"train.seq_len={seq_len}"]
    step_dir = resolve_checkpoint(checkpoint)
    cfg, _ = run_config(step_dir, config, [*overrides, *([f"data.source={data}"] if data else [])])
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_batches": batches or 1 << 30})})
    apply_kernels(cfg)
    apply_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device).type
    p = cfg.parallel
    with process_groups(p.tp, p.pp, p.vpp, p.ep, device) as info:
        if device == "cuda":
            torch.cuda.set_device(info.local_rank)
        dev = torch.device(device, info.local_rank) if device == "cuda" else torch.device("cpu")
        manifest = open_checkpoint(step_dir, what="evaluate it")
        state = TrainState(cfg, info, dev)
        load_weights_into(state.model, step_dir, manifest, info.tp, state.parallel.tp_rank)
        dp_rank = state.parallel.dp_rank
        data = build_data(cfg, dp_rank, info.dp)
        state.documents = data.documents   # the run's document masking (data.document_mask)
        val = data.val
        # Every rank the same count (expert all-to-alls span the data-parallel ranks): a
        # remainder of fewer than dp batches is left out.
        val = val[:len(val) // info.dp * info.dp]
        if not val:
            raise UsageError(f"the validation split has fewer batches than the {info.dp} data-parallel ranks")
        mine = val[dp_rank::info.dp]
        if by_position and state.engine is not None:
            raise UsageError(f"--by-position runs the whole model in one pipeline stage; this layout has "
                             f"parallel.pp={p.pp} (in one process any checkpoint opens with parallel.pp=1)")
        positions = PositionLoss(cfg.train.seq_len) if by_position else None
        total = torch.zeros(3, dtype=torch.float64)  # loss sum, batches, predicted tokens
        bar = tqdm(mine, desc="eval", disable=not (progress and cfg.logging.progress_bar and info.is_main), file=sys.stdout, dynamic_ncols=True)
        for b in bar:
            # a batch [windows, seq_len + 1] predicts seq_len tokens per window
            batch_loss = state.evaluate([b]) if positions is None else _position_batch(state, b, positions)
            total += torch.tensor([batch_loss, 1.0, b[:, 1:].numel()], dtype=torch.float64)
            bar.set_postfix(loss=f"{total[0] / total[1]:.4f}")
        bar.close()
        if info.dp > 1:
            dist.all_reduce(total, group=state.dp_group)
            if positions is not None:
                dist.all_reduce(positions.sums, group=state.dp_group)
                dist.all_reduce(positions.counts, group=state.dp_group)
        loss = float(total[0] / total[1])
        bpt = bytes_per_token(cfg)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                "bits_per_byte": loss / math.log(2) / bpt if bpt else None,
                "batches": int(total[1]), "tokens": int(total[2]),
                "step": manifest["step"], "checkpoint": str(step_dir), "data": cfg.data.source,
                "whole_split": batches == 0, "micro_batch_size": cfg.train.micro_batch_size,
                "seq_len": cfg.train.seq_len,
                **({"by_position": positions.rows()} if positions is not None else {})}


@torch.no_grad()
def _position_batch(state: TrainState, batch: torch.Tensor, positions: PositionLoss) -> float:
    """One batch through the whole model (``TrainState.evaluate``'s forward, returning logits):
    its per-token losses go to ``positions``; returns the batch's mean loss, as ``evaluate``."""
    state.model.eval()
    b = batch.to(state.device)
    segments = state.documents(b)
    with state.autocast:
        logits = state.model(b[:, :-1], **({} if segments is None else {"segments": segments}))
    losses, scored = token_losses(logits, state.targets(b))
    positions.add(losses, scored)
    return float((losses * scored).sum() / scored.sum().clamp_min(1))


def format_result(r: dict) -> str:
    """What was evaluated (split, batches, tokens) on one line, the numbers on the next. The
    trainer's ``val_loss`` covers only its ``train.eval_batches`` first batches of the split."""
    bpb = "n/a (learned tokenizer)" if r["bits_per_byte"] is None else f"{r['bits_per_byte']:.4f}"
    what = ("the whole validation split" if r.get("whole_split")
            else f"the first {r['batches']} batches of the validation split (--batches)")
    return (f"eval {r['checkpoint']} (step {r['step']}): {what} of data.source={r['data']}: "
            f"{r['batches']} batches of {r['micro_batch_size']} windows x {r['seq_len']} tokens = "
            f"{r['tokens']:,} tokens\nloss {r['loss']:.4f} | perplexity {r['perplexity']:.3f} | "
            f"bits per byte {bpb}")
