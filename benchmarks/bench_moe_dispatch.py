"""Benchmark the expert-parallel MoE dispatcher and the grouped-GEMM experts.

    torchrun --nproc-per-node 2 -m benchmarks.bench_moe_dispatch            # 2 GPUs, NCCL
    torchrun --nproc-per-node 2 -m benchmarks.bench_moe_dispatch --device cpu --small
    torchrun --nproc-per-node 8 -m benchmarks.bench_moe_dispatch --routing text   # EP=8, real text + QB

Measured, per rank, on N tokens routed top-k over E experts (E/ep local experts per rank):

1. dispatch + combine (forward, identity experts in between) of ``GroupedAllToAllDispatcher``
   in dynamic and static mode, next to two plain ``all_to_all_single`` calls of ``[N*k, d]``
   with equal splits measured in the same run (the floor: the same payload, no permutation,
   no count exchange, no host sync). GB/s = bytes this rank puts into the all-to-alls (both
   directions; static counts its padded buffers, i.e. what goes on the wire) / time.
   ``vs plain`` = achieved GB/s over the plain all-to-all's GB/s.
2. ``GroupedExperts.forward`` (one ``torch._grouped_mm`` per projection) against
   ``forward_loop`` (one matmul per expert) on the batch the dynamic dispatcher delivered.
3. Host synchronisations of one full step (dispatch, grouped experts, combine, backward):
   * ``host reads``: calls of ``Tensor.tolist``/``Tensor.item`` counted by wrapping both
     methods for the step (every explicit device->host read in our code goes through them);
   * ``cuda syncs`` (GPU only): warnings raised under ``torch.cuda.set_sync_debug_mode("warn")``,
     which also catches implicit syncs inside torch ops (bincount, nonzero, ...).

Timing: CUDA events on GPU, ``time.perf_counter`` on CPU; ``--warmup`` untimed iterations,
then the median of ``--iters``; each iteration starts after a barrier; the reported figure is
the slowest rank's median (an all-to-all finishes when its slowest rank does).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from moe import GroupedAllToAllDispatcher, GroupedExperts, grouped_mm_supported
from benchmarks.host_reads import count_host_reads

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank N")
    p.add_argument("--hidden", type=int, default=1024, help="latent width d the experts see")
    p.add_argument("--ffn", type=int, default=768, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--warmup", type=int, default=None, help="default 5 (--small: 2)")
    p.add_argument("--iters", type=int, default=None, help="default 20 (--small: 5)")
    p.add_argument("--routing", choices=["random", "text"], default="random",
                   help="random: balanced random scores; text: the embedded corpus routed and "
                        "balanced by Quantile Balancing (see text_qb_routing)")
    p.add_argument("--small", action="store_true",
                   help="CPU smoke shape: N=512 d=64 ffn=64 E=8 k=2")
    args = p.parse_args()
    if args.small:
        args.tokens, args.hidden, args.ffn, args.experts, args.topk = 512, 64, 64, 8, 2
    args.warmup = args.warmup if args.warmup is not None else (2 if args.small else 5)
    args.iters = args.iters if args.iters is not None else (5 if args.small else 20)
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    return args


class Timer:
    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters

    def __call__(self, fn) -> float:
        """Median milliseconds of ``fn()``, slowest rank."""
        cuda = self.device.type == "cuda"
        times = []
        for i in range(self.warmup + self.iters):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(self.device)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= self.warmup:
                times.append(ms)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=self.device)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        return float(med.item())


@contextlib.contextmanager
def count_cuda_syncs(device: torch.device):
    """Counts the warnings CUDA's sync debug mode raises inside the block (-1 on CPU)."""
    calls = [-1]
    if device.type != "cuda":
        yield calls
        return
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield calls
        finally:
            torch.cuda.set_sync_debug_mode("default")
    calls[0] = sum("synchroniz" in str(w.message).lower() for w in caught)


def routing(n: int, e: int, k: int, device: torch.device, seed: int):
    """Random sigmoid top-k routing, about balanced: indices ``[N, k]``, weights ``[N, k]``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.sigmoid(torch.randn(n, e, generator=gen)).to(device)
    top = torch.topk(scores, k, dim=-1)
    return top.indices, top.values / top.values.sum(-1, keepdim=True)


def text_qb_routing(n: int, d: int, e: int, k: int, device: torch.device, rank: int):
    """Routing of real text, balanced by one Quantile Balancing update over every rank's tokens.

    Rank r routes tokens ``[r N, (r+1) N)`` of the embedded corpus (byte tokens). Token t's
    router input is ``E1[tok_t] + E2[tok_{t-1}]`` with seeded random tables (the same on every
    rank), so the scores carry real text's skewed byte and bigram frequencies; the router
    ``[E, d]`` is seeded random too. Scores are sigmoid(x W^T); the bias comes from
    ``quantile_balance_distributed`` over all ranks' scores (what the trainer does once per
    step) and only selects: weights are the unbiased scores of the chosen experts, renormalised.
    Returns indices and weights ``[N, k]``, and the global MaxVio before and after the bias.
    """
    from k3train.data.dataset import TokenSource
    from k3train.data.tokenizer import get_tokenizer
    from moe.balancing import quantile_balance_distributed
    from moe.metrics import expert_load, max_vio

    stream = torch.as_tensor(TokenSource.embedded(get_tokenizer("byte")).tokens)
    if (rank + 1) * n + 1 > len(stream):
        raise ValueError(f"--routing text needs {(rank + 1) * n + 1} corpus tokens, it has {len(stream)}")
    tok = stream[rank * n + 1:(rank + 1) * n + 1]
    prev = stream[rank * n:(rank + 1) * n]
    gen = torch.Generator(device="cpu").manual_seed(0)
    e1, e2 = torch.randn(2, 257, d, generator=gen)
    router = torch.randn(e, d, generator=gen) / d ** 0.5
    scores = torch.sigmoid((e1[tok] + e2[prev]) @ router.T).to(device)          # [N, E]

    def global_maxvio(indices):
        load = expert_load(indices, e)
        dist.all_reduce(load)
        return float(max_vio(load))

    raw = torch.topk(scores, k, dim=-1).indices
    bias = quantile_balance_distributed(scores, torch.zeros(e, device=device), k)
    idx = torch.topk(scores + bias, k, dim=-1).indices
    w = scores.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True), global_maxvio(raw), global_maxvio(idx)


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        # Bind the device before creating the NCCL group so barriers use the right GPU.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    n, d, e, k = args.tokens, args.hidden, args.experts, args.topk
    timer = Timer(device, args.warmup, args.iters)
    elt = torch.finfo(dtype).bits // 8

    x = torch.randn(n, d, device=device, dtype=dtype)
    if args.routing == "text":
        idx, w, vio_raw, vio_qb = text_qb_routing(n, d, e, k, device, rank)
    else:
        idx, w = routing(n, e, k, device, seed=rank)
    idx = idx.to(device)
    dispatchers = {"dynamic": GroupedAllToAllDispatcher(e),
                   "static": GroupedAllToAllDispatcher(e, capacity_factor=args.capacity_factor)}
    rows = []

    # ---- 1. dispatch + combine vs a plain all_to_all_single of the same payload
    plain_in = torch.randn(n * k, d, device=device, dtype=dtype)
    plain_out = torch.empty_like(plain_in)

    def plain():
        dist.all_to_all_single(plain_out, plain_in)      # there ...
        dist.all_to_all_single(plain_in, plain_out)      # ... and back, like dispatch + combine

    t_plain = timer(plain)
    bw_plain = 2 * n * k * d * elt / t_plain / 1e6
    rows.append(("plain all_to_all_single x2", t_plain, bw_plain, 1.0, "-", "-"))
    steps = {}
    for name, disp in dispatchers.items():
        def roundtrip(disp=disp):
            xs, _, st = disp.dispatch(x, idx, w)
            return disp.combine(xs, st)
        t = timer(roundtrip)
        sent_rows = n * k if name == "dynamic" else e * disp.capacity(n, k)
        bw = 2 * sent_rows * d * elt / t / 1e6
        steps[name] = disp
        rows.append((f"a2a {name} dispatch+combine", t, bw, bw / bw_plain, None, None))

    # ---- 3. host syncs of a full step (forward + backward) in each mode
    experts = GroupedExperts(e // world, d, args.ffn).to(device=device, dtype=dtype)
    for i, (name, disp) in enumerate(steps.items()):
        xg = x.clone().requires_grad_(True)
        for _ in range(2):   # first call outside the counters: lazy init is not a per-step cost
            with count_host_reads() as reads, count_cuda_syncs(device) as syncs:
                xs, tpe, st = disp.dispatch(xg, idx, w)
                disp.combine(experts(xs, tpe), st).float().sum().backward()
        label, t, bw, ratio, _, _ = rows[1 + i]
        rows[1 + i] = (label, t, bw, ratio, reads[0], syncs[0])
        dropped = torch.tensor([int(st.dropped)], device=device)
        dist.all_reduce(dropped)
        if name == "static" and rank == 0:
            print(f"static: C={disp.capacity(n, k)} slots per (rank, expert), "
                  f"dropped {int(dropped)} of {world * n * k} slots")

    # ---- 2. grouped GEMM vs per-expert loop on the dynamically routed batch
    with torch.no_grad():
        xs, tpe, _ = dispatchers["dynamic"].dispatch(x, idx, w)
        flops = 3 * 2 * xs.shape[0] * d * args.ffn
        gmm_ok = grouped_mm_supported(xs, experts.w_gate)
        t_gmm = timer(lambda: experts(xs, tpe))
        t_loop = timer(lambda: experts.forward_loop(xs, tpe))

    if rank == 0:
        print(f"ep={world} device={args.device} dtype={args.dtype} N={n}/rank d={d} E={e} "
              f"k={k} ffn={args.ffn} capacity_factor={args.capacity_factor} routing={args.routing} "
              f"(median of {args.iters}, slowest rank)")
        if args.routing == "text":
            print(f"text routing: MaxVio over all ranks {vio_raw:.3f} unbalanced -> {vio_qb:.3f} "
                  f"after one Quantile Balancing update")
        print(f"{'what':32s} {'ms':>9s} {'GB/s':>9s} {'vs plain':>9s} {'host reads':>11s} "
              f"{'cuda syncs':>11s}")
        for label, t, bw, ratio, reads, syncs in rows:
            syncs = "n/a" if syncs == -1 else syncs
            print(f"{label:32s} {t:9.3f} {bw:9.2f} {ratio:9.2f} {reads!s:>11s} {syncs!s:>11s}")
        print(f"{'experts':32s} {'ms':>9s} {'TFLOP/s':>9s}   (M={xs.shape[0]} rows on rank 0, "
              f"grouped_mm {'used' if gmm_ok else 'NOT supported: loop fallback'})")
        for label, t in (("GroupedExperts.forward", t_gmm),
                         ("GroupedExperts.forward_loop", t_loop)):
            print(f"{label:32s} {t:9.3f} {flops / t / 1e9:9.2f}")
        print(f"grouped speed-up over loop: {t_loop / t_gmm:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
