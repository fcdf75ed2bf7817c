"""The memory planner (k3train/profiling/memory_plan.py) against measured peak memory on one GPU.

For k3_mini under each ``train.recompute`` mode: a few training steps on one GPU (eager, no CUDA
graph: the graph's pool would hide what the step itself allocates), ``torch.cuda.max_memory_allocated``
over steps 2-3 (step 1 allocates the optimizer state), against the planner's total for the same
layout (parameters + gradients + fp32 main copy under ``precision.param_dtype=bf16`` + optimizer
state in ``optim.state_dtype`` + peak activations + MoE buffers; one GPU, so nothing is
sharded). Target:
measured / predicted within 15%. Beside it, what the forward keeps: the memory allocated when
the first microbatch's backward reaches the head, over the step's start, against the planner's
stored activations of one microbatch (what tells a wrong per-op count from a peak set
elsewhere). Prints a table and writes JSON to ``--json``.

    python3 -m benchmarks.bench_memory_plan --json OUT.json [--config configs/k3_mini.yaml] [--timeline] [key=value ...]
    python3 -m benchmarks.bench_memory_plan --device cpu --config configs/k3_tiny.yaml --modes selective,full \
        --json OUT.json train.microbatches=3 train.micro_batch_size=4 train.seq_len=128     # ~3 min on 2 cores

``--timeline`` profiles one more step per mode with torch.profiler's memory timeline
(benchmarks/memory_timeline.py) and prints where its peak is: the phase of the step
(forward, backward, optimizer), the operator running, and the live bytes by category. On
k3_mini the planner put ``selective``'s peak 2.8 GiB above ``full``'s where the measured peaks
were 0.2-0.4 GiB apart: the timeline says what sets the peak instead.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from benchmarks.common import save_json  # noqa: E402

# Eager (kernels.compile=false) and one autotune candidate keep the first step short; the
# planner is told the same (ops=fused-eager).
DEFAULTS = ["train.device=cuda", "train.cuda_graph=false", "kernels.compile=false",
            "kernels.autotune=fixed", "train.compile_ahead=true"]


def _row(mode: str, peak: float, plan, *, stored: float | None, **extra) -> dict:
    """One table row: the measured peak and stored bytes against the planner's ``plan`` (GiB)."""
    from k3train.profiling.memory_plan import GiB

    row = {"mode": mode, "measured_gib": peak / GiB, "predicted_gib": plan.total(mode, False) / GiB,
           "params_gib": plan.params / GiB, "grads_gib": plan.grads / GiB, "optimizer_gib": plan.optimizer / GiB,
           "master_gib": plan.master / GiB,
           "activations_gib": plan.peak_activations[mode] / GiB, "moe_buffers_gib": plan.moe_buffers / GiB,
           "stored_at_backward_gib": None if stored is None else stored / GiB,
           "predicted_stored_gib": plan.activations[mode] / GiB, **extra}
    row["ratio"] = row["measured_gib"] / row["predicted_gib"]
    return row


def measure(config: str, overrides: list[str], mode: str, steps: int, timeline: bool = False) -> dict:
    from k3train.ops import kernels
    from k3train.config import load_config
    from k3train.runtime.distributed import init_distributed
    from k3train.profiling.memory_plan import plan_memory
    from k3train.trainer.state import TrainState

    cfg = load_config(config, [*DEFAULTS, *overrides, f"train.recompute={mode}"])
    kernels.apply(cfg.kernels, pipeline_gpu=False)
    device = torch.device("cuda")
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device="cuda"), device)
    state.compile_kernels()
    t = cfg.train
    batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size * t.microbatches, t.seq_len + 1))
    t0 = time.perf_counter()
    state.train_step(batch)                       # step 1: optimizer state appears
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    # What the forward keeps: memory allocated when backward reaches the head, over what was
    # allocated before the step (weights, optimizer state; gradients are None between steps).
    # The planner's stored activations of one microbatch are the figure to compare with.
    base, at_backward = torch.cuda.memory_allocated(device), []
    hook = state.model.head.register_full_backward_pre_hook(
        lambda mod, grad: at_backward.append(torch.cuda.memory_allocated(device)) and None)
    losses = [state.train_step(batch)["loss"] for _ in range(steps - 1)]
    hook.remove()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device)
    where = None
    if timeline:  # after the peak is read: the profiled step's own peak is reported apart
        from benchmarks.memory_timeline import format_peak, profile_peak

        where = profile_peak(lambda: state.train_step(batch), device)
        print(f"{mode}: {format_peak(where)}", flush=True)
    ops = "fused-eager" if cfg.kernels.compile is False else "fused"
    row = _row(mode, peak, plan_memory(cfg, ops=ops, act_bytes=2)[0],
               stored=at_backward[0] - base if at_backward else None, seconds=time.perf_counter() - t0,
               losses=losses, timeline_peak=where)
    del state
    gc.collect()
    torch.cuda.empty_cache()
    return row


def measure_cpu(config: str, overrides: list[str], mode: str) -> dict:
    """The same comparison on the CPU, where no allocator counts peaks: the measured peak is the
    memory timeline's (the profiler's exact total of live CPU tensors) over step 2, against the
    planner's torch-form, fp32 total (``ops=torch``, 4 bytes per activation)."""
    from benchmarks.memory_timeline import format_peak, profile_peak

    from k3train.config import load_config
    from k3train.runtime.distributed import init_distributed
    from k3train.profiling.memory_plan import plan_memory
    from k3train.trainer.state import TrainState

    cfg = load_config(config, [*DEFAULTS, "train.device=cpu", *overrides, f"train.recompute={mode}"])
    device = torch.device("cpu")
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device="cpu"), device)
    t = cfg.train
    batch = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size * t.microbatches, t.seq_len + 1))
    t0 = time.perf_counter()
    state.train_step(batch)                       # step 1: optimizer state appears
    where = profile_peak(lambda: state.train_step(batch), device)
    print(f"{mode}: {format_peak(where, 2 ** 20, 'MiB')}", flush=True)
    return _row(mode, where["peak_bytes"], plan_memory(cfg, ops="torch", act_bytes=4)[0], stored=None,
                seconds=time.perf_counter() - t0, timeline_peak=where)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="none,selective,full")
    ap.add_argument("--timeline", action="store_true",
                    help="profile one more step per mode and print where its memory peak is")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the measured peak is the memory timeline's (the torch-form model in fp32)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_memory_plan: no CUDA GPU here; --device cpu compares the planner with the CPU's "
              "memory timeline instead", file=sys.stderr)
        return 2
    rows = []
    for mode in args.modes.split(","):
        rows.append(measure_cpu(args.config, args.overrides, mode) if args.device == "cpu" else
                    measure(args.config, args.overrides, mode, args.steps, timeline=args.timeline))
        r = rows[-1]
        print(f"{mode}: measured {r['measured_gib']:.2f} GiB, predicted {r['predicted_gib']:.2f} GiB "
              f"({r['seconds']:.0f} s)", flush=True)
    print(f"\n{'recompute':<11}{'measured':>10}{'predicted':>11}{'ratio':>7}{'params':>8}{'grads':>7}"
          f"{'master':>7}{'optim':>7}{'act':>7}{'stored':>9}{'predicted':>11}  (GiB; target ratio 0.85-1.15)")
    for r in rows:
        stored = r["stored_at_backward_gib"]
        print(f"{r['mode']:<11}{r['measured_gib']:>10.2f}{r['predicted_gib']:>11.2f}{r['ratio']:>7.2f}"
              f"{r['params_gib']:>8.2f}{r['grads_gib']:>7.2f}{r['master_gib']:>7.2f}{r['optimizer_gib']:>7.2f}{r['activations_gib']:>7.2f}"
              f"{stored if stored is not None else float('nan'):>9.2f}{r['predicted_stored_gib']:>11.2f}")
    print("stored: allocated when the first microbatch's backward reaches the head, over the step's "
          "start (one microbatch's kept activations, logits included), against the planner's")
    save_json(args.json, {"config": args.config, "overrides": args.overrides,
                          "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "rows": rows})
    return 0 if all(0.85 <= r["ratio"] <= 1.15 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
