"""Plots are written as non-empty PNG files, including ragged and degenerate inputs."""
import json

import numpy as np
import torch

from k3train.trainer.plots import plot_attnres_depth_heatmap, plot_expert_load_heatmap, plot_loss_curves, write_run_plots

PNG = b"\x89PNG\r\n\x1a\n"


def _is_png(path):
    data = path.read_bytes()
    return len(data) > 1000 and data[:8] == PNG


def test_plots_write_pngs(tmp_path):
    recs = [{"step": s, "loss": 5.0 / s, **({"val_loss": 4.0 / s} if s % 2 == 0 else {})} for s in range(1, 9)]
    assert _is_png(plot_loss_curves({"a": recs, "b": recs[:3]}, tmp_path / "loss.png"))
    load = torch.tensor([[10.0, 0.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert _is_png(plot_expert_load_heatmap(load, tmp_path / "load.png"))
    weights = [np.array([1.0]), torch.tensor([0.3, 0.7]), [0.2, 0.3, 0.5]]
    assert _is_png(plot_attnres_depth_heatmap(weights, tmp_path / "depth.png"))


def test_write_run_plots(tmp_path):
    assert write_run_plots(tmp_path) == {}
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "loss": 1.0 / s, "val_loss": 2.0 / s}) for s in (1, 2, 3)) + "\n{\"step\"")
    paths = write_run_plots(tmp_path)
    assert paths == {"loss": tmp_path / "loss.png"} and _is_png(paths["loss"])
