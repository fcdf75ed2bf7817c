"""End-of-run pictures (written as PNGs in the run directory and logged to wandb) and the
peak FLOP/s that MFU is measured against."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from k3train.model.attnres import DepthAttention, record_depth_weights
from k3train.model.flops import datasheet_peak_flops
from k3train.model.layer import K3Layer
from k3train.model.model import K3Chunk
from k3train.trainer.plots import plot_attnres_depth_heatmap, plot_expert_load_heatmap, write_run_plots
from k3train.trainer.state import engine_microbatch


def datasheet_peak(device: torch.device) -> tuple[float | None, str]:
    """(one device's datasheet dense bf16 peak FLOP/s or None, the banner's words for it): MFU's
    denominator, as the field counts it; none on a CPU or an unknown GPU model."""
    if device.type != "cuda":
        return None, f"not reported on {device.type} (no datasheet peak)"
    name = torch.cuda.get_device_name(device)
    peak = datasheet_peak_flops(name)
    if peak is None:
        return None, f"not reported: no datasheet peak known for {name} (k3train/model/flops.py)"
    return peak, f"against {peak / 1e12:.0f} TFLOP/s ({name} datasheet, dense bf16)"


def measure_peak_flops(device: torch.device) -> float:
    """Dense matmul FLOP/s of this device, measured once (bf16 8192^3 on CUDA, fp32 1024^3 on
    CPU): ``matmul_util``'s denominator (how close the step gets to this machine's own GEMM
    rate), which is not MFU."""
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


def _depth_modules(model: torch.nn.Module) -> dict[tuple[int, int], DepthAttention]:
    """This rank's AttnRes sublayers keyed by their place in the whole model: ``(layer, 0)``
    before the mixer, ``(layer, 1)`` before the FFN, ``(num_layers, 0)`` the final one."""
    found: dict[tuple[int, int], DepthAttention] = {}
    for m in model.modules():
        if isinstance(m, K3Layer) and m.block_size is not None:
            found[(m.index, 0)], found[(m.index, 1)] = m.mixer_res, m.ffn_res
        elif isinstance(m, K3Chunk) and m.last and m.attnres:
            found[(m.layer_range[1], 0)] = m.final_res
    return found


@torch.no_grad()
def depth_attention_weights(state, batch: torch.Tensor, targets) -> list[torch.Tensor]:
    """Mean softmax weight each AttnRes sublayer gives to each source, on one batch, in layer
    order (mixer, ffn per layer, then the final AttnRes) over the whole model. Empty for the
    standard residual.

    Collective: every rank runs the forward (pipeline hops, TP and EP exchanges run as in an
    evaluation) and the weights are gathered; where ranks hold the same sublayer (TP, EP, DP
    replicas) the lowest rank's, which saw the main rank's batch, is kept."""
    modules = _depth_modules(state.model)
    state.model.eval()
    # As the evaluation runs (no grad: the decorator; the run's autocast): in fp32 with grad, fla's forward
    # kernels met launches (fp32 tensors) that neither compile-ahead nor the shipped autotune
    # picks cover, and a fresh machine tuned 8 of them for about 90 s at the end of a run.
    with state.autocast, record_depth_weights(state.model) as rec:
        if state.engine is not None:
            # The interleaved schedule (vpp > 1) needs at least P microbatches: run the same one
            # P times, so every recorded weight is still this batch's.
            copies = state.engine.P if state.engine.V > 1 else 1
            # Under CP each rank runs its slice (the hops' shapes are the training step's).
            mb = engine_microbatch(state, batch) if state.cp > 1 else (batch[:, :-1], targets(batch))
            state.engine.eval_step([mb] * copies)
        elif state.cp > 1:  # this rank's slice, as the training step's (the mixers exchange)
            x, t, seg, divisor = engine_microbatch(state, batch)
            state.model(x, t, segments=seg, loss_tokens=divisor)
        else:
            state.model(batch[:, :-1], targets(batch))
    mine = {key: rec.weights[m].float().cpu() for key, m in modules.items()}
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    merged: dict[tuple[int, int], torch.Tensor] = {}
    for weights in everyone:                  # in rank order: the lowest rank wins
        for key, w in weights.items():
            merged.setdefault(key, w)
    return [merged[key] for key in sorted(merged)]


def write_end_of_run_plots(run_dir: Path, state, val_batch: torch.Tensor, targets,
                           main: bool = True) -> dict[str, Path]:
    """Write ``loss.png``, ``expert_load.png`` and ``attnres_depth.png`` (on the main rank;
    returns their paths there, ``{}`` elsewhere). Collective: every rank calls it, as the load
    matrix and the depth weights are gathered from the ranks that hold the layers."""
    loads = state.moe_stats.load_matrix() if state.moe_stats is not None else None
    weights = depth_attention_weights(state, val_batch.to(state.device), targets)
    if not main:
        return {}
    paths = write_run_plots(run_dir)
    if loads is not None:
        paths["expert_load"] = plot_expert_load_heatmap(loads, run_dir / "expert_load.png")
    if weights:
        paths["attnres_depth"] = plot_attnres_depth_heatmap(weights, run_dir / "attnres_depth.png")
    return paths
