"""Run logging: ``metrics.jsonl`` (always), wandb (offline unless configured otherwise) and, with
``logging.tensorboard``, TensorBoard event files in ``RUN_DIR/tensorboard/``: one record feeds all
three."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from k3train.config.schema import WandbConfig
from k3train.errors import UsageError
from k3train.runtime.files import write_text_atomic

TENSORBOARD_INSTALL = "pip install 'k3train[tensorboard]'"


class MetricsLogger:
    """Main-rank logger. ``log(record)`` appends one JSON line and forwards the same record to
    wandb and TensorBoard."""

    def __init__(self, run_dir: Path, wandb_cfg: WandbConfig, config: dict, enabled: bool = True,
                 resume: bool = False, keep_through: int | None = None, tensorboard: bool = False):
        """``resume``: append to the existing file; ``keep_through``: with ``resume``, the step
        of the checkpoint resumed from: records of later steps (logged before a crash, after
        that save) are dropped, as the resumed run logs those steps again. ``tensorboard``:
        also write event files to ``run_dir/tensorboard/`` (``logging.tensorboard``); without
        the ``tensorboard`` package that is a ``UsageError`` naming the pip command."""
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb = None
        self._wandb_starting: Future | None = None
        self._tensorboard = None
        if not enabled:
            return
        if tensorboard:  # first: a refusal leaves metrics.jsonl as it was
            self._tensorboard = _start_tensorboard(Path(run_dir), keep_through if resume else None)
        if not resume and self.path.exists():
            self.path.unlink()
        if resume and keep_through is not None:
            _drop_records_after(self.path, keep_through)
        if wandb_cfg.mode != "disabled":
            self._wandb_starting = _start_wandb(Path(run_dir), wandb_cfg, config)

    def _wandb_run(self):
        """The wandb run (None without one), once its start (``_start_wandb``) has finished."""
        if self._wandb_starting is not None:
            starting, self._wandb_starting = self._wandb_starting, None
            self._wandb = starting.result()  # an error of wandb.init is raised here
        return self._wandb

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb_run() is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self._tensorboard is not None:
            for key, value in record.items():
                # scalars only, under the JSONL key ("moe/maxvio" groups as TensorBoard's moe/ section)
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, global_step=record["step"])
            self._tensorboard.flush()  # a killed run keeps what it logged, as metrics.jsonl does

    def log_images(self, paths: dict[str, str | Path], step: int) -> None:
        """Log PNGs (e.g. from ``k3train.trainer.plots``) as ``plots/<key>`` in one wandb step; files
        that do not exist are skipped, so a plot that could not be drawn never stops a run."""
        if self._wandb_run() is None:
            return
        import wandb

        # Under "plots/": a bare "loss" image would replace the scalar "loss" series at this step.
        images = {f"plots/{k}": wandb.Image(str(p)) for k, p in paths.items() if Path(p).is_file()}
        if images:
            self._wandb.log(images, step=step)

    def close(self) -> None:
        if self._wandb_run() is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without the records of steps after ``step``, and without a
    torn last line that a kill mid-write can leave."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
    if len(kept) < len(lines):
        write_text_atomic(path, "".join(f"{line}\n" for line in kept))


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _start_wandb(run_dir: Path, cfg: WandbConfig, config: dict) -> Future:
    """``wandb.init`` for this run, as a future of the run (None: no wandb run).

    Offline (the default) it runs on a thread of its own: importing wandb and starting its
    service process take 1-2 s that need not delay the first step; the logger waits for it at
    its first use. Online it runs here, before training: it may ask for a login."""
    # An explicit WANDB_MODE in the environment wins (e.g. a user who exported it for a cluster).
    mode = os.environ.get("WANDB_MODE", cfg.mode)
    done: Future = Future()
    if mode == "disabled":
        done.set_result(None)
        return done
    if "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None:
        print("[k3train] wandb is not installed: logging to metrics.jsonl only "
              "(pip install wandb, or set logging.wandb.mode=disabled to silence this)")
        done.set_result(None)
        return done

    def init():
        import wandb

        return wandb.init(
            project=cfg.project, group=cfg.group, name=cfg.name or run_dir.name, dir=str(run_dir),
            mode=mode, config=config, settings=wandb.Settings(silent=True, console="off"),
        )

    if mode != "offline":
        done.set_result(init())
        return done
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wandb-init")
    starting = pool.submit(init)
    pool.shutdown(wait=False)  # the thread ends with init()
    return starting


def _start_tensorboard(run_dir: Path, keep_through: int | None):
    """A ``SummaryWriter`` on ``run_dir/tensorboard/``. ``keep_through``: a resume's checkpoint
    step; TensorBoard then hides the earlier event files' records of later steps (``purge_step``),
    as ``metrics.jsonl`` drops them."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's module imports the tensorboard package
        raise UsageError(f"logging.tensorboard=true needs the tensorboard package: {TENSORBOARD_INSTALL} "
                         f"(or pip install 'tensorboard>=2.16,<2.22'), or set logging.tensorboard=false") from None
    purge = keep_through + 1 if keep_through is not None else None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
