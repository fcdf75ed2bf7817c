"""Plots are written as non-empty PNG files, including ragged and degenerate inputs."""
import json

import numpy as np
import torch

from k3train.runtime.distributed import init_distributed
from k3train.trainer.report import depth_attention_weights
from k3train.trainer.state import TrainState
from k3train.trainer.plots import plot_attnres_depth_heatmap, plot_expert_load_heatmap, plot_loss_curves, write_run_plots
from tests.helpers import small_cfg

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


def test_depth_plot_forward_runs_as_the_evaluation():
    """The end-of-run AttnRes plot's forward runs without grad and under the run's autocast, as
    ``TrainState.evaluate`` does: in fp32 with grad its fla kernels met launches that neither
    compile-ahead nor the shipped autotune picks cover (a fresh H200 tuned 8 kernels, ~90 s)."""
    cfg = small_cfg()
    state = TrainState(cfg, init_distributed(device="cpu"), torch.device("cpu"))
    state.autocast = torch.autocast("cpu", dtype=torch.bfloat16)   # CPU runs have none: stand in
    seen = []
    first = next(m for m in state.model.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda m, i, o: seen.append((torch.is_grad_enabled(), o.dtype)))
    batch = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len + 1))
    weights = depth_attention_weights(state, batch, lambda b: b[:, 1:])
    assert seen == [(False, torch.bfloat16)]
    assert weights and all(torch.isfinite(torch.as_tensor(w)).all() for w in weights)
