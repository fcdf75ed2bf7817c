"""A sweep's figures: per variant one line, the mean over its seeds, with the seeds' range
(min..max) as a shaded band; without seeds one line per run. The data come from
``k3train.sweep.curves`` (the functions results.md's columns come from)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: a training node has no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from k3train.sweep.curves import FINAL_OF, seed_curves  # noqa: E402

BAND = "band: min..max over seeds"


def _label(group: str, curve: dict) -> str:
    return f"{group} (mean of {curve['n']} seeds)" if curve["n"] > 1 else group


def sweep_figure(panels: Sequence[tuple[str, Mapping[str, dict]]], *, ylabel: str, log_y: bool = False):
    """A figure with one axis per ``(title, curves)`` panel (``curves``: ``seed_curves``'s
    output). Each variant is a line through its means; with several seeds a band from the
    lowest to the highest seed in the line's colour, named in the legend (``BAND``)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharex=True, squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels):
        for group, c in curves.items():
            (line,) = ax.plot(c["steps"], c["mean"], marker="o" if len(c["steps"]) < 12 else None,
                              markersize=3, label=_label(group, c))
            if c["n"] > 1:
                ax.fill_between(c["steps"], c["lo"], c["hi"], color=line.get_color(), alpha=0.2, linewidth=0)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if any(c["n"] > 1 for c in curves.values()):
            handles.append(Patch(facecolor="grey", alpha=0.3, label=BAND))
        if handles:
            ax.legend(handles=handles, fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_sweep_plots(records_by_run: Mapping[str, Sequence[dict]], group_of: Mapping[str, str],
                      out: Path) -> dict[str, Path]:
    """``out/loss_curves.png`` (train loss; validation loss where logged) and, for MoE runs,
    ``out/maxvio_curves.png`` (``moe/maxvio_running``, whose last value is results.md's
    ``maxvio_running``). Returns {"loss": path, "maxvio": path (MoE runs only)}."""
    train = seed_curves(records_by_run, group_of, FINAL_OF["final_train_loss"])
    val = seed_curves(records_by_run, group_of, FINAL_OF["final_val_loss"])
    panels = [("train loss", train)] + ([("validation loss", val)] if val else [])
    paths = {"loss": _save(sweep_figure(panels, ylabel="loss (nats/token)"), out / "loss_curves.png")}
    maxvio = seed_curves(records_by_run, group_of, FINAL_OF["maxvio_running"])
    if maxvio:
        title = "MoE MaxVio of the load since step 1 (results.md: maxvio_running)"
        fig = sweep_figure([(title, maxvio)], ylabel="MaxVio (max load / mean load - 1)", log_y=True)
        paths["maxvio"] = _save(fig, out / "maxvio_curves.png")
    return paths
