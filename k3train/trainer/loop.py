"""The training run (``train``, ``Trainer``): set-up, the step loop (evaluation, logging,
checkpoints, signals) and the end of the run."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from k3train.config import RunConfig
from k3train.errors import TrainingStopped
from k3train.model.flops import flops_per_token
from k3train.ops import kernels
from k3train.ops.autotune_picks import write_picks
from k3train.runtime.cuda_env import prepare_cuda_env
from k3train.runtime.device import resolve_device
from k3train.runtime.distributed import init_distributed, parallel_context
from k3train.runtime.env_report import commit as source_commit
from k3train.runtime.threads import apply_threads
from k3train.trainer import faults
from k3train.trainer.async_save import CheckpointWriter
from k3train.trainer.context import RunContext
from k3train.trainer.data import build_data
from k3train.trainer.guards import last_checkpoint_note, params_finite
from k3train.trainer.metrics import MetricsLogger
from k3train.trainer.plots import preload_pyplot
from k3train.trainer.report import datasheet_peak, measure_peak_flops, write_end_of_run_plots
from k3train.trainer.restore import data_record, data_source, init_from, restore_training
from k3train.trainer.run_dir import decided_on_rank0, keep_recorded_settings, plan_run_dir, save_config
from k3train.trainer.run_lock import RunDirLock
from k3train.trainer.state import TrainState
from k3train.trainer.state_io import rank_state
from k3train.trainer.stop import SignalGuard, stop_agreed


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, stop_at: int | None = None,
          overwrite: bool = False) -> dict:
    """Run training; returns a summary dict. ``stop_at`` ends the run early after that step
    (as a preemption would), keeping the schedule of ``train.steps``. A ``run_dir`` that holds
    a run needs ``resume`` (continue it) or ``overwrite`` (archive it, start over): see
    ``k3train.trainer.run_dir``. Rank 0 holds the run directory's lock
    (k3train/trainer/run_lock.py) for the whole run, before anything in the directory is read or
    written; a second run on the directory raises ``RunDirError``."""
    # The global rank from torchrun's environment: the lock comes before the process group.
    # The stop-signal guard covers the whole run, end-of-run work included (trainer/stop.py).
    with SignalGuard(), RunDirLock(run_dir, enabled=int(os.environ.get("RANK", "0")) == 0):
        return Trainer(cfg, run_dir, resume=resume, stop_at=stop_at, overwrite=overwrite).run()


def _record_autotune_picks(run_dir: Path, dev: torch.device, main: bool) -> None:
    """``RUN_DIR/autotune_picks.json``: the candidate each Triton autotuner chose in this run
    (full autotuning on CUDA), for ``kernels.autotune_picks`` on the next machine of this model."""
    if main and dev.type == "cuda" and kernels.autotune_mode() == "full":
        write_picks(Path(run_dir) / "autotune_picks.json")


class Trainer:
    """One training run on this rank, in three parts: ``set_up`` (kernels, device, process
    groups, the run directory's plan, data, the rank's ``TrainState``, resume or fine-tuning
    start, config and logger), ``run_loop`` (the steps: evaluation, logging, checkpoints,
    signals) and ``end_of_run`` (plots, the logger's close, the summary line). ``run`` does the
    three; ``train`` is the entry point that also holds the run directory's lock."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False,
                 stop_at: int | None = None, overwrite: bool = False):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.resume, self.stop_at, self.overwrite = resume, stop_at, overwrite
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.summary: dict = {"first_loss": None, "last_loss": None, "val_loss": None, "steps": 0,
                              "stopped_by_signal": False}

    def run(self) -> dict:
        self.set_up()
        self.run_loop()
        return self.end_of_run()

    def set_up(self) -> None:
        """Everything before step 1: nothing in the run directory is written before its plan
        (``plan_run_dir``) and a resume's load have succeeded."""
        cfg, run_dir = self.cfg, self.run_dir
        prepare_cuda_env(cfg)
        choices = kernels.apply(cfg)  # the run's kernels: section decides every op family's backend
        self.device = device = resolve_device(cfg.train.device).type
        apply_threads(cfg.train.threads)
        p = cfg.parallel
        self.info = info = init_distributed(p.tp, p.pp, p.vpp, p.ep, device, cp=p.cp)
        if device == "cuda":
            torch.cuda.set_device(info.local_rank)
        self.dev = dev = torch.device(device, info.local_rank) if device == "cuda" else torch.device("cpu")
        self.main = main = info.is_main
        self.layout = {**info.__dict__, "zero1": cfg.optim.zero1}
        resume_from = decided_on_rank0(
            lambda: plan_run_dir(run_dir, self.resume, self.overwrite, info.world_size, self.layout))
        if resume_from is not None:   # the run's own data.document_mask (run_dir.RECORDED_ON_RESUME)
            self.cfg = cfg = keep_recorded_settings(cfg, run_dir, print if main else (lambda _: None))

        ctx = parallel_context(info, p2p_backend=cfg.pipeline.p2p_backend)
        self.context = RunContext(parallel=ctx, device=dev, kernels=choices)  # built once per run
        self.data = build_data(cfg, ctx.dp_rank, info.dp)
        self.state = state = TrainState(cfg, info, dev, targets=self.data.targets, parallel=ctx,
                                        documents=self.data.documents)
        self.writer = CheckpointWriter(asynchronous=cfg.train.async_save)  # collective when asynchronous
        self.data_record = data_record(cfg)  # every checkpoint's manifest names the data it was trained on
        self.peak_flops = measure_peak_flops(dev)
        self.datasheet_flops, mfu_words = datasheet_peak(dev)
        self.flops_token = flops_per_token(cfg)
        self.start_step = 0
        if resume_from is not None:
            self.start_step = restore_training(state, self.data, resume_from, self.layout, run_dir, main)
            if cfg.train.init_from and main:
                print(f"[k3train] train.init_from={cfg.train.init_from} ignored: resuming this run's own checkpoint")
        elif cfg.train.init_from:
            init_from(state, cfg.train.init_from, main)
        self.summary["steps"] = self.start_step
        if main:  # only now: a refused resume must leave the config its checkpoints were saved with
            save_config(cfg, run_dir / "config.yaml")
            kernels.write_resolved(run_dir, dev)
        if main and cfg.train.plots:
            preload_pyplot()  # imported while the run trains, for the end-of-run plots
        if cfg.train.compile_ahead:
            state.compile_kernels()
        self.logger = MetricsLogger(run_dir, cfg.logging.wandb, cfg.model_dump(mode="json"), enabled=main,
                                    resume=self.resume and self.start_step > 0, keep_through=self.start_step,
                                    tensorboard=cfg.logging.tensorboard)
        if main:
            print(f"[k3train] code {source_commit()} | device {device} | world {info.world_size} "
                  f"(tp {p.tp} pp {p.pp} vpp {p.vpp} ep {p.ep}{f' cp {p.cp}' if p.cp > 1 else ''} dp {info.dp}) | {state.describe()}")
            val_tokens = sum(b[:, 1:].numel() for b in self.data.val)  # predicted positions
            print(f"[k3train] data: {self.data.description}; val loss over {len(self.data.val)} batches, "
                  f"{val_tokens:,} tokens (train.eval_batches={cfg.train.eval_batches}; k3train eval "
                  f"covers the whole split)")
            print(f"[k3train] mfu: {mfu_words}; matmul_util: against this device's measured matmul rate")
            print(f"[k3train] cuda graphs: {state.graph_words}")
            if cfg.optim.warmup_steps >= cfg.train.steps:
                print(f"[k3train] warning: optim.warmup_steps={cfg.optim.warmup_steps} >= train.steps="
                      f"{cfg.train.steps}: the learning rate never leaves its warm-up")

    def run_loop(self) -> None:
        """Steps ``start_step + 1`` to ``train.steps`` (or ``stop_at``); stops after a saved
        step when any rank got SIGTERM/SIGINT (``SignalGuard``)."""
        cfg, state, data, main, dev = self.cfg, self.state, self.data, self.main, self.dev
        summary, info = self.summary, self.info
        tokens_per_step = cfg.train.micro_batch_size * cfg.train.microbatches * info.dp * cfg.train.seq_len
        last_step = min(cfg.train.steps, self.stop_at or cfg.train.steps)
        bar = tqdm(total=last_step, initial=self.start_step, disable=not (main and cfg.logging.progress_bar),
                   desc="train", dynamic_ncols=True, file=sys.stdout)
        skips, window_tokens, window_start = 0, 0, time.perf_counter()
        # The guard is shared with the run's guard entered in train(); the save in flight
        # commits before the loop ends.
        with SignalGuard() as guard, contextlib.ExitStack() as saves:
            saves.callback(self.writer.wait)
            for step in range(self.start_step + 1, last_step + 1):
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
                        f"lower optim.lr or inspect the data. "
                        f"{last_checkpoint_note(self.ckpt_dir, cfg.checkpoint.interval)}")
                window_tokens += tokens_per_step
                if step == self.start_step + 1:
                    _record_autotune_picks(self.run_dir, dev, main)  # step 1 tuned every kernel it launched
                loss = out["loss"]
                summary["first_loss"] = summary["first_loss"] if summary["first_loss"] is not None else loss
                summary["last_loss"], summary["steps"] = loss, step
                bar.update(1)
                if step % cfg.train.log_interval == 0 or step == last_step:
                    elapsed = time.perf_counter() - window_start
                    record = self._record(step, lr, out, window_tokens / max(elapsed, 1e-9), last_step)
                    self.logger.log(record)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                    **({"val": f"{record['val_loss']:.4f}"} if "val_loss" in record else {}))
                    if "val_loss" in record and main and not step == last_step:
                        # Not only in metrics.jsonl: an evaluation is worth a line of its own (the
                        # last one is in the closing "done:" line).
                        bar.write(f"[k3train] step {step}: val loss {record['val_loss']:.4f} "
                                  f"(train loss {loss:.4f})")
                    window_tokens, window_start = 0, time.perf_counter()
                interval = cfg.checkpoint.interval
                # Every rank stops at the same step when any one got a signal (k3train/trainer/stop.py).
                signalled = stop_agreed(guard.requested, dev)
                if (interval and step % interval == 0) or signalled or step == last_step:
                    self._save(step)
                if signalled:
                    self.writer.wait()
                    summary["stopped_by_signal"] = True
                    if main:
                        print(f"\n[k3train] signal received: saved step {step} to {self.ckpt_dir}; exiting")
                    break
        bar.close()

    def _record(self, step: int, lr: float, out: dict, tok_s: float, last_step: int) -> dict:
        """The metrics line of ``step`` (with the validation loss at eval steps)."""
        cfg, state = self.cfg, self.state
        record = {"step": step, "loss": out["loss"], "lr": lr, "grad_norm": out["grad_norm"],
                  "tokens_per_s": tok_s,
                  "matmul_util": tok_s * self.flops_token / (self.peak_flops * self.info.world_size),
                  "skipped": int(not out["finite"]), **state.moe_metrics(), **state.pipeline_metrics(),
                  **state.cp_metrics()}
        if self.datasheet_flops is not None:
            record["mfu"] = tok_s * self.flops_token / (self.datasheet_flops * self.info.world_size)
        if self.dev.type == "cuda":
            record["memory_gib"] = torch.cuda.max_memory_allocated(self.dev) / 2**30
        if step % cfg.train.eval_interval == 0 or step == last_step:
            record["val_loss"] = self.summary["val_loss"] = state.evaluate(self.data.val)
        return record

    def _save(self, step: int) -> None:
        """Checkpoint ``step`` (collective); refused when the parameters are not finite."""
        state, ctx = self.state, self.state.parallel
        if not params_finite(state.params, self.dev):
            raise TrainingStopped(
                f"step {step}: the parameters hold inf or NaN values, so step {step} was not saved "
                f"(it could not resume); lower optim.lr or inspect the data. "
                f"{last_checkpoint_note(self.ckpt_dir, self.cfg.checkpoint.interval)}")
        coords = {"pp": ctx.pp_rank, "tp": ctx.tp_rank, "ep": ctx.ep_rank, "dp": ctx.dp_rank}
        self.writer.save(self.ckpt_dir, step, lambda: rank_state(state, step, self.data.train.state_dict(),
                                                                 data_source(self.cfg),
                                                                 host=self.writer.host,
                                                                 data_record=self.data_record),
                         layout=self.layout, keep_last=self.cfg.checkpoint.keep_last, coords=coords)

    def end_of_run(self) -> dict:
        """Plots of a run that trained (collective), the logger closed, the summary line."""
        summary, main = self.summary, self.main
        if summary["steps"] > self.start_step:
            if self.cfg.train.plots:
                # Every rank: the load matrix and AttnRes weights are gathered from the ranks holding the layers.
                paths = write_end_of_run_plots(self.run_dir, self.state, self.data.val[0], self.data.targets,
                                               main=main)
                self.logger.log_images({k: str(v) for k, v in paths.items()}, step=summary["steps"])
            # What evaluation and the plots' forward tuned since step 1 (recorded after both, so
            # a fresh machine given this file tunes nothing).
            _record_autotune_picks(self.run_dir, self.dev, main)
        self.logger.close()
        if main and summary["last_loss"] is not None:
            val = "n/a" if summary["val_loss"] is None else f"{summary['val_loss']:.4f}"
            losses = (f"train loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, "
                      f"val loss {val}")
            if summary["stopped_by_signal"]:  # not done: say where it stopped and how to go on
                print(f"[k3train] stopped by a signal at step {summary['steps']} of {self.cfg.train.steps}, "
                      f"saved to {self.ckpt_dir}; {losses}; rerun with --resume to continue")
            else:
                print(f"[k3train] done: step {summary['steps']}, {losses}")
        return summary
