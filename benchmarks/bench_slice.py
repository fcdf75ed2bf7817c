"""The K3 slice (configs/k3_slice.yaml: K3's widths, 4 layers, 32 experts) trained on one GPU.

    python3 -m benchmarks.bench_slice [--json OUT] [--microbatches 16 --seq 4096]
    python3 -m benchmarks.bench_slice --device cpu --small --microbatches 2 --seq 32  # dry run

Per optimizer row (``--optims``, default muon: K3's optimizer; ``muon,adamw`` adds AdamW at
about twice the run time -- each row builds the 6.5B-parameter model, on the CPU first as the
trainer does), all in this one run. MFU is model FLOPs (``k3train.model.flops``) per second over
the GPU's datasheet dense bf16 peak (989 TFLOP/s on H100/H200), as the field counts it;
``matmul_util`` is the same FLOP rate over a bf16 8192^3 matmul rate measured in this run (how
close to what this GPU's GEMMs reach), a second figure, not MFU:

* ``fwd_bwd_ms``: the forward and backward of every microbatch of one update (``mbs x seq x
  microbatches`` tokens, 64K by default), no optimizer; ``mfu_fwd_bwd`` / ``matmul_util_fwd_bwd``.
* ``optimizer_ms``: the update alone (clip, Muon's Newton-Schulz on every matrix / AdamW).
* ``step_ms``, ``mfu_step`` / ``matmul_util_step``: ``TrainState.train_step``, what ``k3train
  train`` runs.
* ``extrapolated_256k``: the optimizer's share of a step at 256K tokens per update, from the
  measured forward+backward time per token and the measured update -- extrapolated, not run
  (the update does not depend on the batch; forward+backward is linear in microbatches).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings

import torch

from benchmarks.bench_step import SMALL, optimizer_ms, time_steps  # noqa: E402
from benchmarks.common import matmul_tflops, profile_table, save_json  # noqa: E402
from k3train.model.flops import datasheet_peak_flops  # noqa: E402
from k3train.ops import kernels  # noqa: E402

warnings.filterwarnings("ignore")

EXTRAPOLATE_TOKENS = 256 * 1024


def fwd_bwd_ms(state, batch, device: str, iters: int) -> float:
    """Median ms of the forward+backward of every microbatch of ``batch`` (gradients dropped)."""
    def run():
        state._forward_backward(batch)
        state.optimizer.zero_grad(set_to_none=True)
        for layer in state.moe_layers:
            layer.routing.clear()
    return statistics.median(time_steps(lambda _: run(), [None] * (iters + 1), 1, device)) * 1e3


def slice_row(args, optim: str, peak_tflops: float) -> dict:
    from k3train.config import load_config
    from k3train.runtime.distributed import init_distributed
    from k3train.model.flops import flops_per_token
    from k3train.trainer.state import TrainState

    overrides = [*(SMALL + ["model.dense_layers=0"] if args.small else []), f"optim.name={optim}",
                 f"train.device={args.device}", f"train.micro_batch_size={args.mbs}",
                 f"train.seq_len={args.seq}", f"train.microbatches={args.microbatches}",
                 "train.cuda_graph=false", *args.override]
    cfg = load_config(args.config, overrides)
    kernels.apply(cfg)   # the config's kernels: section (an --override kernels.autotune=fixed acts)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device=args.device), dev)
    compiled = state.compile_kernels()
    tokens = args.mbs * args.seq * args.microbatches
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (args.mbs * args.microbatches, args.seq + 1), generator=g)
               for _ in range(args.steps + 1)]
    losses = []
    step_s = statistics.median(time_steps(lambda b: losses.append(state.train_step(b)["loss"]), batches, 1, args.device))
    fb_ms = fwd_bwd_ms(state, batches[0], args.device, args.steps)
    opt_ms = optimizer_ms(state, batches[0], args.device)
    fpt = flops_per_token(cfg, args.seq)
    row = {"optim": optim, "tokens_per_update": tokens, "step_ms": step_s * 1e3, "fwd_bwd_ms": fb_ms,
           "optimizer_ms": opt_ms, "tokens_per_s": tokens / step_s, "flops_per_token": fpt,
           "params": sum(p.numel() for p in state.params), "losses": losses, "compile_ahead": compiled}
    per_token_ms = fb_ms / tokens
    fb_big = per_token_ms * EXTRAPOLATE_TOKENS
    row["extrapolated_256k"] = {"tokens_per_update": EXTRAPOLATE_TOKENS, "fwd_bwd_ms": fb_big,
                                "optimizer_share_of_step": opt_ms / (fb_big + opt_ms),
                                "optimizer_over_fwd_bwd": opt_ms / fb_big, "extrapolated": True}
    rates = {"fwd_bwd": tokens * fpt / (fb_ms * 1e-3), "step": tokens * fpt / step_s}
    datasheet = datasheet_peak_flops(torch.cuda.get_device_name()) if args.device == "cuda" else None
    for part, rate in rates.items():
        if datasheet:
            row[f"mfu_{part}"] = rate / datasheet
        if peak_tflops > 0:
            row[f"matmul_util_{part}"] = rate / (peak_tflops * 1e12)
    if args.device == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    if args.profile:  # where forward+backward's time goes: what keeps MFU below its target
        def one_fwd_bwd():
            state._forward_backward(batches[0])
            state.optimizer.zero_grad(set_to_none=True)
            for layer in state.moe_layers:
                layer.routing.clear()
        print(f"profile of one update's forward+backward ({optim}):\n"
              + profile_table(one_fwd_bwd, iters=1, rows=30, device=args.device), flush=True)
    del state
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_slice.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU dry run)")
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=16, help="per update (16 x 4096 = 64K tokens)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--optims", default="muon", help="comma list of muon, adamw")
    ap.add_argument("--profile", action="store_true", help="print the top operators of one forward+backward")
    ap.add_argument("--override", action="append", default=[], help="extra config override (repeatable)")
    ap.add_argument("--json")
    args = ap.parse_args()
    peak = matmul_tflops() if args.device == "cuda" else 0.0
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "bf16_matmul_tflops": peak, "config": args.config, "rows": {}}
    for optim in args.optims.split(","):
        try:
            result["rows"][optim] = row = slice_row(args, optim, peak)
        except torch.OutOfMemoryError as exc:  # report, keep the other rows
            result["rows"][optim] = row = {"error": f"out of memory: {str(exc)[:200]}"}
        print(json.dumps({optim: row}), flush=True)
        save_json(args.json, result)
    print(f"\nmatmul rate measured in this run: {peak:.0f} TFLOP/s (bf16 8192^3)")
    print("MFU: against the datasheet dense bf16 peak; util: against the matmul rate measured above")
    print(f"{'optim':<8}{'tok/update':>11}{'fwd+bwd ms':>12}{'opt ms':>9}{'step ms':>10}{'MFU f+b':>9}"
          f"{'MFU step':>10}{'util f+b':>10}{'util step':>10}{'opt share @256K (extrap.)':>27}{'peak GiB':>10}")
    for name, r in result["rows"].items():
        if "error" in r:
            print(f"{name:<8} failed: {r['error']}")
            continue
        pct = (lambda k: f"{r[k]:.1%}" if k in r else "-")
        print(f"{name:<8}{r['tokens_per_update']:>11}{r['fwd_bwd_ms']:>12.1f}{r['optimizer_ms']:>9.1f}"
              f"{r['step_ms']:>10.1f}{pct('mfu_fwd_bwd'):>9}{pct('mfu_step'):>10}"
              f"{pct('matmul_util_fwd_bwd'):>10}{pct('matmul_util_step'):>10}"
              f"{r['extrapolated_256k']['optimizer_share_of_step']:>27.1%}{r.get('peak_mem_gib', 0):>10.1f}")
    save_json(args.json, result)


if __name__ == "__main__":
    main()
