"""The training run: set-up, the step loop, evaluation, logging, checkpoints, signals."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from megatron.core import parallel_state
from tqdm import tqdm

from k3train.ops import kernels
from k3train.config import RunConfig, save_config
from k3train.runtime.cuda_env import prepare_cuda_env
from k3train.runtime.distributed import init_distributed
from k3train.errors import TrainingStopped, UsageError
from k3train.trainer import faults
from k3train.trainer.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from k3train.trainer.data import build_data
from k3train.trainer.guards import last_checkpoint_note, params_finite
from k3train.model.flops import flops_per_token
from k3train.trainer.metrics import MetricsLogger
from k3train.trainer.report import measure_peak_flops, write_end_of_run_plots
from k3train.trainer.run_lock import RunDirLock
from k3train.trainer.run_dir import decided_on_rank0, load_error, plan_run_dir
from k3train.trainer.state import TrainState
from k3train.trainer.state_io import load_rank_state, rank_state
from k3train.trainer.stop import stop_agreed


def parallel_coords() -> dict:
    """This rank's indices in megatron-core's parallel groups (recorded in checkpoints)."""
    ps = parallel_state
    return {"pp": ps.get_pipeline_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank()}


def pick_device(choice: str) -> str:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def code_version() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class _SignalGuard:
    """First SIGTERM/SIGINT: finish the step, checkpoint, exit 0. Another one, ``REPEAT_S`` or
    more later: abort at once. Repeats within ``REPEAT_S`` are the same stop request delivered
    more than once: SLURM signals every process of a job step, and torchrun and
    scripts/run_torchrun.sh forward the one they got, so a worker sees two or three SIGTERMs
    within milliseconds and must still save."""

    REPEAT_S = 5.0

    def __init__(self):
        self.requested = False
        self._first = 0.0
        self._previous = {}

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.requested and now - self._first >= self.REPEAT_S:
            raise KeyboardInterrupt(f"second signal {signum}: aborting without a checkpoint")
        if not self.requested:
            self.requested, self._first = True, now

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


_LAYOUT_SHOWN = ("tp", "pp", "vpp", "ep", "dp", "zero1")


def _layout_text(layout: dict) -> str:
    return " ".join(f"{k} {layout.get(k)}" for k in _LAYOUT_SHOWN)


def _resume(state: TrainState, data, path: Path, layout: dict, run_dir: Path, main: bool) -> int:
    """Load checkpoint ``path`` into ``state`` and ``data``; returns its step. A checkpoint stored
    by global name loads under any layout; an older one (per-rank state dicts) only under its own
    layout or another data-parallel size."""
    manifest = verify_checkpoint(path, state.info.world_size, layout)
    try:
        if "tensors" in manifest:
            step, data_state, source, notes = load_rank_state(state, path, manifest, layout, parallel_coords())
        else:
            _, saved = load_checkpoint(path, layout=layout, coords=parallel_coords())
            step, data_state, source, notes = state.load_state_dict(saved), saved["data"], None, []
        data.train.load_state_dict(data_state)
    except (RuntimeError, KeyError, ValueError) as exc:  # shapes or keys of another model
        raise load_error(path, exc, run_dir) from None
    if main:
        saved = manifest["layout"]
        moved = "" if all(saved.get(k) == layout.get(k) for k in _LAYOUT_SHOWN) else (
            f"; resharded from ({_layout_text(saved)}) to ({_layout_text(layout)})")
        print(f"[k3train] resumed from {path} (step {step}){moved}")
        for note in notes:
            print(f"[k3train] note: {note}")
        if source is not None and source != data_source(state.cfg):
            print(f"[k3train] WARNING: {path} was trained on {source}; this run reads {data_source(state.cfg)}. "
                  f"The optimizer, schedule and data position continue from step {step}; to start them "
                  f"fresh on the new data, use train.init_from={path} in a new run directory")
    return step


def data_source(cfg: RunConfig) -> str:
    """What the run trains on, as recorded in its checkpoints."""
    return f"data.source={cfg.data.source} (tokenizer {cfg.data.tokenizer})"


def _init_from(state: TrainState, spec: str, main: bool) -> None:
    """Start from the weights of checkpoint ``spec`` (any layout); nothing else is taken."""
    from k3train.quant.export import resolve_checkpoint
    from k3train.trainer.state_io import load_weights

    spec_path = Path(spec)
    if (spec_path / "model.safetensors.index.json").is_file():
        _init_from_hf(state, spec_path, main)
        return
    path = resolve_checkpoint(spec_path / "checkpoints" if (spec_path / "checkpoints" / "latest").is_file() else spec_path)
    manifest = verify_checkpoint(path, state.info.world_size, None)
    if "tensors" not in manifest:
        raise UsageError(f"train.init_from={spec}: {path} is a checkpoint of the older per-rank format; "
                         f"resume it with its own layout once (it is then saved by global name) and use that")
    load_weights(state.model, path, manifest, state.info.tp, state.parallel.tp_rank)
    if main:
        print(f"[k3train] fine-tuning: weights from {path} (step {manifest['step']}, layout "
              f"{_layout_text(manifest['layout'])}); fresh optimizer, lr schedule and data position")


def _init_from_hf(state: TrainState, hf_dir: Path, main: bool) -> None:
    """Start from the weights of a Hugging Face directory (``k3train export --format hf``): every
    rank reads it and copies its own part. Its config.json must describe this run's model."""
    from k3train.hf.load import load_hf, merge_model_config
    from k3train.trainer.state_io import load_weights_from_tensors

    model_cfg, tensors = load_hf(hf_dir, state.cfg)
    theirs = merge_model_config(state.cfg, model_cfg)
    if (theirs.model, theirs.moe) != (state.cfg.model, state.cfg.moe):
        mine, other = state.cfg.model_dump(), theirs.model_dump()
        diff = [f"{sec}.{k}: {other[sec][k]!r} there, {mine[sec][k]!r} here" for sec in ("model", "moe")
                for k in mine[sec] if mine[sec][k] != other[sec][k]]
        raise UsageError(f"train.init_from={hf_dir}: its config.json describes another model ({'; '.join(diff[:3])}); "
                         f"`k3train import {hf_dir} --out RUN_DIR` writes its config.yaml to start from")
    load_weights_from_tensors(state.model, tensors, state.info.tp, state.parallel.tp_rank, str(hf_dir))
    if main:
        print(f"[k3train] fine-tuning: weights from the Hugging Face directory {hf_dir}; fresh optimizer, "
              f"lr schedule and data position")


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, stop_at: int | None = None,
          overwrite: bool = False) -> dict:
    """Run training; returns a summary dict. ``stop_at`` ends the run early after that step
    (as a preemption would), keeping the schedule of ``train.steps``. A ``run_dir`` that holds
    a run needs ``resume`` (continue it) or ``overwrite`` (archive it, start over): see
    ``k3train.trainer.run_dir``. Rank 0 holds the run directory's lock
    (k3train/trainer/run_lock.py) for the whole run, before anything in the directory is read or
    written; a second run on the directory raises ``RunDirError``."""
    # The global rank from torchrun's environment: the lock comes before the process group.
    with RunDirLock(run_dir, enabled=int(os.environ.get("RANK", "0")) == 0):
        return _train(cfg, run_dir, resume=resume, stop_at=stop_at, overwrite=overwrite)


def _record_autotune_picks(run_dir: Path, dev: torch.device, main: bool) -> None:
    """``RUN_DIR/autotune_picks.json``: the candidate each Triton autotuner chose in this run
    (full autotuning on CUDA), for ``kernels.autotune_picks`` on the next machine of this model."""
    if main and dev.type == "cuda" and kernels.autotune_mode() == "full":
        from k3train.ops.autotune_picks import write_picks

        write_picks(Path(run_dir) / "autotune_picks.json")


def _train(cfg: RunConfig, run_dir: str | Path, resume: bool, stop_at: int | None, overwrite: bool) -> dict:
    run_dir = Path(run_dir)
    prepare_cuda_env(cfg)
    kernels.apply(cfg)  # the run's kernels: section decides every op family's backend
    device = pick_device(cfg.train.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    p = cfg.parallel
    info = init_distributed(p.tp, p.pp, p.vpp, p.ep, device)
    if device == "cuda":
        torch.cuda.set_device(info.local_rank)
    dev = torch.device(device, info.local_rank) if device == "cuda" else torch.device("cpu")
    main = info.is_main
    layout = {**info.__dict__, "zero1": cfg.optim.zero1}
    resume_from = decided_on_rank0(lambda: plan_run_dir(run_dir, resume, overwrite, info.world_size, layout))

    data = build_data(cfg, parallel_state.get_data_parallel_rank(), info.dp)
    state = TrainState(cfg, info, dev, targets=data.targets)
    peak_flops = measure_peak_flops(dev)
    flops_token = flops_per_token(cfg)
    ckpt_dir = run_dir / "checkpoints"
    start_step = 0
    if resume_from is not None:
        start_step = _resume(state, data, resume_from, layout, run_dir, main)
        if cfg.train.init_from and main:
            print(f"[k3train] train.init_from={cfg.train.init_from} ignored: resuming this run's own checkpoint")
    elif cfg.train.init_from:
        _init_from(state, cfg.train.init_from, main)
    if main:  # only now: a refused resume must leave the config its checkpoints were saved with
        save_config(cfg, run_dir / "config.yaml")
        kernels.write_resolved(run_dir, dev)
    if cfg.train.compile_ahead:
        state.compile_kernels()
    logger = MetricsLogger(run_dir, cfg.logging.wandb, cfg.model_dump(mode="json"), enabled=main,
                           resume=resume and start_step > 0, keep_through=start_step)
    if main:
        print(f"[k3train] code {code_version()} | device {device} | world {info.world_size} "
              f"(tp {p.tp} pp {p.pp} dp {info.dp}) | {state.describe()}")
        print(f"[k3train] data: {data.description}")

    tokens_per_step = cfg.train.micro_batch_size * cfg.train.microbatches * info.dp * cfg.train.seq_len
    last_step = min(cfg.train.steps, stop_at or cfg.train.steps)
    bar = tqdm(total=last_step, initial=start_step, disable=not (main and cfg.logging.progress_bar),
               desc="train", dynamic_ncols=True, file=sys.stdout)
    summary: dict = {"first_loss": None, "last_loss": None, "val_loss": None, "steps": start_step,
                     "stopped_by_signal": False}
    skips, window_tokens, window_start = 0, 0, time.perf_counter()
    with _SignalGuard() as guard:
        for step in range(start_step + 1, last_step + 1):
            lr = state.schedule_lr(step)
            faults.maybe_crash(step)
            out = state.train_step(next(data.train), poison=faults.active("nan", step))
            skips = 0 if out["finite"] else skips + 1
            if not out["finite"] and main:
                print(f"\n[k3train] step {step}: non-finite loss or gradient, update skipped "
                      f"({skips} in a row, limit {cfg.train.max_consecutive_skips})")
            if skips >= cfg.train.max_consecutive_skips:
                raise TrainingStopped(
                    f"{skips} consecutive steps had a non-finite loss or gradient (last at step {step}); "
                    f"lower optim.lr or inspect the data. {last_checkpoint_note(ckpt_dir, cfg.checkpoint.interval)}")
            window_tokens += tokens_per_step
            if step == start_step + 1:
                _record_autotune_picks(run_dir, dev, main)  # step 1 tuned every kernel it launched
            loss = out["loss"]
            summary["first_loss"] = summary["first_loss"] if summary["first_loss"] is not None else loss
            summary["last_loss"], summary["steps"] = loss, step
            bar.update(1)
            if step % cfg.train.log_interval == 0 or step == last_step:
                elapsed = time.perf_counter() - window_start
                tok_s = window_tokens / max(elapsed, 1e-9)
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": out["grad_norm"],
                          "tokens_per_s": tok_s, "mfu": tok_s * flops_token / (peak_flops * info.world_size),
                          "skipped": int(not out["finite"]), **state.moe_metrics(), **state.pipeline_metrics()}
                if dev.type == "cuda":
                    record["memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
                if step % cfg.train.eval_interval == 0 or step == last_step:
                    record["val_loss"] = summary["val_loss"] = state.evaluate(data.val)
                logger.log(record)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                window_tokens, window_start = 0, time.perf_counter()
            interval = cfg.checkpoint.interval
            # Every rank stops at the same step when any one got a signal (k3train/trainer/stop.py).
            signalled = stop_agreed(guard.requested, dev)
            stop_now = signalled or step == last_step
            if (interval and step % interval == 0) or stop_now:
                if not params_finite(state.params, dev):
                    raise TrainingStopped(
                        f"step {step}: the parameters hold inf or NaN values, so step {step} was not saved "
                        f"(it could not resume); lower optim.lr or inspect the data. "
                        f"{last_checkpoint_note(ckpt_dir, interval)}")
                content, index = rank_state(state, step, data.train.state_dict(), data_source(cfg))
                save_checkpoint(ckpt_dir, step, content, layout=layout, keep_last=cfg.checkpoint.keep_last,
                                coords=parallel_coords(), index=index)
            if signalled:
                summary["stopped_by_signal"] = True
                if main:
                    print(f"\n[k3train] signal received: saved step {step} to {ckpt_dir}; exiting")
                break
    bar.close()
    if summary["steps"] > start_step:
        _record_autotune_picks(run_dir, dev, main)  # and what evaluation tuned since
        # Every rank: the load matrix and AttnRes weights are gathered from the ranks holding the layers.
        paths = write_end_of_run_plots(run_dir, state, data.val[0], data.targets, main=main)
        logger.log_images({k: str(v) for k, v in paths.items()}, step=summary["steps"])
    logger.close()
    if main and summary["last_loss"] is not None:
        val = "n/a" if summary["val_loss"] is None else f"{summary['val_loss']:.4f}"
        print(f"[k3train] done: step {summary['steps']}, train loss {summary['first_loss']:.4f} -> "
              f"{summary['last_loss']:.4f}, val loss {val}")
    return summary
