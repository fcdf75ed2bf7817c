"""Training-step time and loss of precision recipes: bf16 vs fp8 (torchao) vs mxfp4_qat emulation.

    python3 -m benchmarks.bench_fp8 --out runs/bench_fp8                  # one H200
    python3 -m benchmarks.bench_fp8 --preset slice --recipes bf16 fp8 --steps 10 --warmup 3 \
        --out runs/bench_fp8_slice                                          # K3 widths, one H200
    python3 -m benchmarks.bench_fp8 --device cpu --small --out /tmp/b     # CPU smoke (no fp8)
    ... --profile 25                  # then one step of each recipe profiled: its 25 costliest kernels

Each recipe builds the same model from the same seed (``TrainState``, exactly what ``k3train
train`` runs: bf16 autocast on CUDA, the recipe applied at build time with its default
``precision.scope`` unless ``--scope`` is given), trains ``--steps`` steps on the same data
stream, and records every step's loss and wall time (a step ends with the trainer's own host
sync on the loss). The step time is the median over the steps after ``--warmup``; the table
gives each recipe's ratio to bf16 measured in this same run. Results: ``OUT/bench_fp8.json``
and the loss curves ``OUT/bench_fp8_loss.png``.

The default GPU model is k3_mini-like but wide and FFN-heavy (hidden 2048, latent 2048, a
8192-wide shared expert) so that the modules fp8 converts (latent projections and shared
experts, plain ``nn.Linear``) carry most of the FLOPs. mxfp4_qat is emulated (fake-quant in
fp32 then a bf16 GEMM): on Hopper it costs time, it does not save any; it is here to measure
that overhead.

``--preset slice``: configs/k3_slice.yaml (K3's widths: hidden 7168, KDA/MLA with 96 heads,
latent 3584) as the fp8 target was measured there: 32 experts top-1, AdamW, 4 x 4096 tokens per
update (``moe.topk=1``, ``train.microbatches=4``). fp8's default scope covers the attention
projections, latent projections and shared experts; the routed experts stay bf16 (no grouped
float8 GEMM here), which is why top-1 (few expert FLOPs) is the shape where fp8 can pay. fp8 is skipped with its one-line reason when it cannot run (CPU, no torchao,
compute capability < 8.9).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from k3train.config import load_config
from k3train.runtime.distributed import init_distributed
from k3train.quant.recipes import validate_precision
from k3train.trainer.data import build_data
from k3train.trainer.state import TrainState

WIDE = ["model.hidden_size=2048", "model.num_layers=4", "model.dense_layers=1", "model.ffn.intermediate_size=8192",
        "model.kda.num_heads=16", "model.kda.head_dim=128", "model.mla.num_heads=16",
        "moe.num_experts=16", "moe.topk=2", "moe.latent_size=2048", "moe.expert_ffn_size=1024",
        "moe.num_shared_experts=1", "moe.shared_ffn_size=8192",
        "train.seq_len=2048", "train.micro_batch_size=4", "optim.name=adamw"]
# configs/k3_slice.yaml at the fp8 target's measurement: 32 experts top-1, AdamW, 4 x 4096 tokens.
# AdamW at a rate that trains the 7168-wide model stably with 16K-token updates, warmed up over
# 5 steps (the yaml's 2e-3 is Muon's). Until 2026-12-02 this script never applied the schedule
# (the trainer's loop does, TrainState.train_step does not), so every step ran at the full rate:
# both recipes jumped from loss 7.1 to 28 (2.2e-4) or 62 (2e-3) at step 2 on an H200. On the CPU
# at the same width (2 layers, 24 heads, 4 experts, 256 tokens), with the warm-up applied,
# 2.2e-4 still climbed to 13 by step 5; 3e-5 fell from 7.4 to 4.6-4.9 over 8 steps.
SLICE = ["moe.topk=1", "optim.name=adamw", "optim.lr=3e-5", "optim.warmup_steps=5",
         "train.micro_batch_size=1", "train.microbatches=4", "train.seq_len=4096", "train.cuda_graph=false"]
SMALL = ["model.hidden_size=64", "model.num_layers=4", "model.kda.num_heads=2", "model.kda.head_dim=32",
         "model.mla.num_heads=2", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
         "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16",
         "model.ffn.intermediate_size=128", "moe.num_experts=4", "moe.topk=2", "moe.latent_size=32",
         "moe.expert_ffn_size=32", "moe.shared_ffn_size=64", "train.seq_len=32", "train.micro_batch_size=4"]


def profile_step(state, batch, device: torch.device, rows: int) -> list[dict]:
    """One more training step under torch.profiler: the ``rows`` kernels (CUDA) or operators (CPU)
    with the most self time, as ``{"name", "ms", "calls"}`` (the step's total first)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        state.train_step(batch)
    key = (lambda e: e.self_device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if key(e) > 0), key=key, reverse=True)
    total = sum(key(e) for e in events) / 1e3
    return [{"name": "total self time", "ms": total, "calls": None}] + [
        {"name": e.key, "ms": key(e) / 1e3, "calls": e.count} for e in events[:rows]]


def run_recipe(recipe: str, args, device: torch.device) -> dict:
    preset = {"small": SMALL, "wide": WIDE, "slice": SLICE}["small" if args.small else args.preset]
    overrides = [*preset, f"train.device={device.type}", f"train.steps={args.steps}",
                 f"precision.recipe={recipe}", "logging.wandb.mode=disabled", "logging.progress_bar=false",
                 *args.overrides]
    if args.scope:
        overrides.append("precision.scope=" + json.dumps(args.scope))
    cfg = load_config(args.config, overrides)
    try:
        validate_precision(cfg.precision, device)
    except ValueError as exc:
        return {"skipped": str(exc)}
    info = init_distributed(device=device.type)
    torch.manual_seed(cfg.train.seed)
    state = TrainState(cfg, info, device)
    state.compile_kernels()  # Triton kernels and autotune candidates in parallel, before step 1
    data = build_data(cfg, 0, 1)
    losses, times = [], []
    for step in range(1, args.steps + 1):
        batch = next(data.train)
        state.schedule_lr(step)  # the config's warm-up, as the trainer applies it
        t0 = time.perf_counter()
        out = state.train_step(batch)  # ends with .item(): the step is finished on the device
        times.append(time.perf_counter() - t0)
        losses.append(out["loss"])
    timed = times[args.warmup:] or times
    result = {"quantized": state.model.quantized, "losses": losses, "step_s": times,
              "median_step_s": statistics.median(timed),
              "tokens_per_step": cfg.train.micro_batch_size * cfg.train.microbatches * cfg.train.seq_len}
    if args.profile:
        result["profile"] = profile_step(state, next(data.train), device, args.profile)
    del state
    if device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke test)")
    p.add_argument("--preset", default="wide", choices=["wide", "slice"],
                   help="wide: k3_mini-like FFN-heavy model; slice: configs/k3_slice.yaml at top-1")
    p.add_argument("--config", help="default: configs/k3_slice.yaml for --preset slice, else configs/k3_mini.yaml")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    p.add_argument("--recipes", nargs="+", default=["bf16", "fp8", "mxfp4_qat"])
    p.add_argument("--scope", nargs="+", help="precision.scope patterns for every recipe (default: each recipe's)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, profile one more step of each recipe and print its N "
                        "kernels with the most device time (CPU: operators by self time)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = p.parse_args(argv)
    args.config = args.config or ("configs/k3_slice.yaml" if args.preset == "slice" and not args.small
                                  else "configs/k3_mini.yaml")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible; use --device cpu --small")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")

    results = {r: run_recipe(r, args, device) for r in args.recipes}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"preset": "small" if args.small else args.preset, "config": args.config, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup, "small": args.small}
    (out / "bench_fp8.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    base = results.get("bf16", {}).get("median_step_s")
    print(f"{'recipe':<10} {'step ms':>9} {'speed-up vs bf16':>17} {'tok/s':>10} {'final loss':>10}  quantised modules")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<10} skipped: {r['skipped']}")
            continue
        ms = r["median_step_s"] * 1e3
        ratio = f"{base / r['median_step_s']:.2f}x" if base else "n/a"  # > 1: faster than bf16
        print(f"{name:<10} {ms:>9.1f} {ratio:>17} {r['tokens_per_step'] / r['median_step_s']:>10.0f} "
              f"{r['losses'][-1]:>10.4f}  {len(r['quantized'])}")
    for name, r in results.items():
        for i, row in enumerate(r.get("profile", [])):
            if i == 0:
                print(f"\n{name}: one step profiled, {row['ms']:.1f} ms of {'device' if device.type == 'cuda' else 'CPU'} self time")
                continue
            print(f"  {row['ms']:>9.2f} ms {row['calls']:>6}x  {row['name'][:110]}")
    from k3train.trainer.plots import plot_loss_curves

    curves = {name: [{"step": i + 1, "loss": v} for i, v in enumerate(r["losses"])]
              for name, r in results.items() if "losses" in r}
    if curves:
        plot_loss_curves(curves, out / "bench_fp8_loss.png")
    print(f"wrote {out / 'bench_fp8.json'} and the loss curves {out / 'bench_fp8_loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
