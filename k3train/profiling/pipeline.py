"""``k3train profile-pipeline``: a few pipeline steps with each AttnRes transport, their p2p
bytes next to the engine's prediction and the closed forms, the bubble, and timelines.

    torchrun --nproc-per-node 2 -m k3train profile-pipeline --config configs/k3_tiny.yaml \
        --json runs/profile/pipeline.json parallel.pp=2 parallel.vpp=2 train.microbatches=4
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from k3train.errors import LayoutError
from k3train.config import RunConfig
from k3train.runtime.distributed import init_distributed, parallel_context
from k3train.trainer.data import build_data
from k3train.runtime.device import resolve_device
from k3train.trainer.state import TrainState
from pipeline import CommRecorder

TRANSPORTS = ("naive", "cached")


def _run_transport(cfg: RunConfig, info, device, transport: str, steps: int):
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"attnres_transport": transport})})
    parallel = parallel_context(info, p2p_backend=cfg.pipeline.p2p_backend)
    data = build_data(cfg, parallel.dp_rank, info.dp)
    recorder = CommRecorder()
    state = TrainState(cfg, info, device, recorder=recorder, parallel=parallel)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state.train_step(next(data.train))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    recorder.gather(parallel.pp_group)
    return recorder, sorted(times)[len(times) // 2]


def profile_pipeline(cfg: RunConfig, json_path: str | Path, steps: int = 3) -> dict | None:
    """Collective over all ranks; returns the report on global rank 0 (None elsewhere)."""
    p = cfg.parallel
    if p.pp * p.vpp < 2:
        raise LayoutError("profile-pipeline needs parallel.pp * parallel.vpp >= 2 (e.g. parallel.pp=2)")
    device_name = resolve_device(cfg.train.device).type
    info = init_distributed(p.tp, p.pp, p.vpp, p.ep, device_name, cp=p.cp)
    device = torch.device("cuda", info.local_rank) if device_name == "cuda" else torch.device("cpu")
    out_dir = Path(json_path).parent
    report: dict = {}
    for transport in TRANSPORTS:
        recorder, step_s = _run_transport(cfg, info, device, transport, steps)
        if not info.is_main:
            continue
        table, bubble = recorder.bytes_table(), recorder.bubble_fraction()
        report[transport] = {
            "measured_bytes": table["measured_fwd"], "predicted_bytes": table["predicted_fwd"],
            "measured_block_bytes": table["measured_fwd"] - table["hidden_bytes"],
            "predicted_block_bytes": table["predicted_block_bytes"],
            "closed_form_block_bytes": table["closed_form_block_bytes"],
            "cached_exact_block_bytes": table["cached_exact_block_bytes"],
            "hidden_bytes": table["hidden_bytes"], "measured_bwd_bytes": table["measured_bwd"],
            "per_hop": table["rows"], "peak_cache_bytes": table["peak_cache_bytes"],
            "bubble_fraction": bubble["measured"], "step_time_s": step_s,
        }
        print(recorder.format_bytes_table())
        if transport == "cached":
            report["bubble_fraction"], report["bubble_theory"] = bubble["measured"], bubble["theory"]
            out_dir.mkdir(parents=True, exist_ok=True)
            recorder.write_chrome_trace(out_dir / "pipeline_trace.json")
            recorder.write_gantt_png(out_dir / "pipeline_gantt.png")
    if not info.is_main:
        return None
    naive, cached = report["naive"]["measured_bytes"], report["cached"]["measured_bytes"]
    report["naive_over_cached"] = naive / cached if cached else float("inf")
    report["layout"] = {"pp": p.pp, "vpp": p.vpp, "microbatches": cfg.train.microbatches, "dp": info.dp}
    Path(json_path).write_text(json.dumps(report, indent=1))
    print(f"\nP={p.pp} V={p.vpp} m={cfg.train.microbatches}: forward p2p bytes per step "
          f"naive {naive:,} / cached {cached:,} = {report['naive_over_cached']:.2f}x")
    print(f"block bytes: cached measured {report['cached']['measured_block_bytes']:,}, "
          f"exact formula {report['cached']['cached_exact_block_bytes']:,.0f}, "
          f"K3 upper-bound form {report['cached']['closed_form_block_bytes']:,.0f}; "
          f"naive measured {report['naive']['measured_block_bytes']:,}, "
          f"closed form {report['naive']['closed_form_block_bytes']:,.0f}")
    print(f"peak cache memory (cached, per rank): {report['cached']['peak_cache_bytes']}")
    print(f"bubble: measured {report['bubble_fraction']:.3f} vs (P-1)/(V*m) = {report['bubble_theory']:.3f}")
    print(f"wrote {json_path}, {out_dir / 'pipeline_trace.json'} (open in Perfetto), {out_dir / 'pipeline_gantt.png'}")
    return report
