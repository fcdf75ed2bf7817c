"""Run and sweep plots as PNG files (matplotlib, Agg backend: no display needed).

Every function writes one PNG and returns its path, so the same files can go to the run
directory and to wandb (``MetricsLogger.log_images``).
"""
from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

__all__ = ["preload_pyplot", "read_metrics", "plot_loss_curves", "plot_expert_load_heatmap", "plot_attnres_depth_heatmap",
           "write_run_plots"]


def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported at the first plot rather than with this
    module: a ``k3train train`` process with ``train.plots: false`` never pays its import
    (~0.5 s of every start-up)."""
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: a training node has no display
    import matplotlib.pyplot as plt

    return plt


def preload_pyplot() -> None:
    """Import pyplot (``_pyplot``) on a daemon thread, for a run that plots at its end: the
    import (~0.5 s) then overlaps the steps, where the host mostly waits on the device, instead
    of delaying "done". The first plot's own import waits for this one (Python's import lock)."""
    threading.Thread(target=_pyplot, name="pyplot-import", daemon=True).start()


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (a half-written last line is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _run_line(ax, steps, values, name: str) -> None:
    """One run's curve: markers only when it has few points."""
    ax.plot(steps, values, marker="o" if len(steps) < 12 else None, markersize=3, label=name)


def plot_loss_curves(records_by_name: Mapping[str, Sequence[dict]], path: str | Path) -> Path:
    """Train loss (left) and validation loss (right) against step, one line per run; the
    validation panel is left out when no record has ``val_loss``.

    ``records_by_name``: run name -> its metrics records (dicts with ``step``, ``loss`` and,
    at eval steps, ``val_loss``).
    """
    keys = ["loss"]
    if any("val_loss" in r for records in records_by_name.values() for r in records):
        keys.append("val_loss")
    fig, axes = _pyplot().subplots(1, len(keys), figsize=(5.5 * len(keys), 4), sharex=True, squeeze=False)
    axes = list(axes[0])
    for name, records in records_by_name.items():
        for ax, key in zip(axes, keys):
            steps, values = _series(records, key)
            if steps:
                _run_line(ax, steps, values, name)
    for ax, title in zip(axes, ("train loss", "validation loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("loss (nats/token)")
    fig.tight_layout()
    return _save(fig, path)


def _heatmap(mat, path, title: str, *, cmap: str, vmax: float, label: str, xlabel: str, ylabel: str,
             size: tuple[float, float]) -> Path:
    fig, ax = _pyplot().subplots(figsize=size)
    im = ax.imshow(mat, aspect="auto", cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
    fig.colorbar(im, ax=ax, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_expert_load_heatmap(load_matrix, path: str | Path, title: str = "expert load") -> Path:
    """``load_matrix`` [L, E] (tokens per expert per MoE layer, e.g. ``LoadTracker.load_matrix()``).

    Each row is shown as the fraction of that layer's tokens, scaled by E so that 1.0 is
    perfectly balanced; the colour range is centred on 1.
    """
    mat = np.asarray(load_matrix.cpu() if hasattr(load_matrix, "cpu") else load_matrix, dtype=np.float64)
    if mat.ndim != 2:
        raise ValueError(f"load_matrix must be [layers, experts], got shape {mat.shape}")
    totals = mat.sum(axis=1, keepdims=True)
    rel = np.divide(mat * mat.shape[1], totals, out=np.zeros_like(mat), where=totals > 0)
    top = max(2.0, float(rel.max()) if rel.size else 2.0)
    return _heatmap(rel, path, title, cmap="coolwarm", vmax=top, label="load / balanced load",
                    xlabel="expert", ylabel="MoE layer",
                    size=(max(5, 0.25 * mat.shape[1] + 3), max(3, 0.35 * mat.shape[0] + 1.5)))


def plot_attnres_depth_heatmap(weights_by_sublayer: Sequence, path: str | Path,
                               title: str = "AttnRes depth attention") -> Path:
    """Which earlier blocks each sublayer reads.

    ``weights_by_sublayer``: one array [S_i] per sublayer (in order), the mean softmax weight it
    gives each source (``DepthWeights.weights``: source 0 is the embedding, the last may
    be the current block's partial sum). Rows are ragged; missing sources are NaN (blank).
    """
    rows = [np.asarray(w.detach().cpu() if hasattr(w, "detach") else w, dtype=np.float64).ravel()
            for w in weights_by_sublayer]
    if not rows:
        raise ValueError("no sublayer weights to plot")
    width = max(len(r) for r in rows)
    mat = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        mat[i, : len(r)] = r
    return _heatmap(np.ma.masked_invalid(mat), path, title, cmap="viridis", vmax=1.0, label="mean weight",
                    xlabel="source (0 = embedding, then completed blocks, then partial)", ylabel="sublayer",
                    size=(max(4, 0.4 * width + 3), max(3, 0.25 * len(rows) + 1.5)))


def write_run_plots(run_dir: str | Path) -> dict[str, Path]:
    """Read ``run_dir/metrics.jsonl`` and write ``run_dir/loss.png``; returns ``{"loss": path}``
    (empty when the run has no metrics yet)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return {}
    records = read_metrics(metrics)
    if not records:
        return {}
    return {"loss": plot_loss_curves({run_dir.name: records}, run_dir / "loss.png")}
