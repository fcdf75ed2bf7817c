"""End-of-run pictures (written as PNGs in the run directory and logged to wandb) and the
peak FLOP/s that MFU is measured against."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from k3train.model.attnres import DepthAttention
from k3train.plots import plot_attnres_depth_heatmap, plot_expert_load_heatmap, write_run_plots


def measure_peak_flops(device: torch.device) -> float:
    """Dense matmul FLOP/s of this device, measured once (bf16 8192^3 on CUDA, fp32 1024^3 on
    CPU): MFU is reported against what the hardware does here, not a datasheet."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


@torch.no_grad()
def depth_attention_weights(model: torch.nn.Module, batch: torch.Tensor, targets) -> list[torch.Tensor]:
    """Mean softmax weight each AttnRes sublayer gives to each source, on one batch, in layer
    order (mixer, ffn per layer, then the final AttnRes). Empty for the standard residual."""
    modules = [m for m in model.modules() if isinstance(m, DepthAttention)]
    if not modules:
        return []
    for m in modules:
        m.record = True
    model.eval()
    model(batch[:, :-1], targets(batch))
    for m in modules:
        m.record = False
    return [m.last_weights.float().cpu() for m in modules]


def write_end_of_run_plots(run_dir: Path, state, val_batch: torch.Tensor, targets) -> dict[str, Path]:
    paths = write_run_plots(run_dir)
    if state.loads is not None:
        paths["expert_load"] = plot_expert_load_heatmap(state.loads.load_matrix(), run_dir / "expert_load.png")
    # Only where this rank alone can run a forward (no pipeline peers, TP or EP collectives).
    if state.engine is None and state.info.tp == 1 and state.info.ep == 1:
        weights = depth_attention_weights(state.model, val_batch.to(state.device), targets)
        if weights:
            paths["attnres_depth"] = plot_attnres_depth_heatmap(weights, run_dir / "attnres_depth.png")
    return paths
