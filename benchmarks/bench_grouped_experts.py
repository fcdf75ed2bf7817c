"""Grouped expert GEMMs at K3's real widths on one GPU, against one dense GEMM of the same FLOPs.

One expert-parallel rank's share of K3's 896 experts (latent 3584, expert FFN 3072): 112 experts
at EP=8, 56 at EP=16. With balanced routing a rank receives ``tokens * 16`` rows (every rank
sends each of its tokens to 16 experts, and the ranks' shares add up), so ``--tokens`` is the
tokens per rank and the grouped GEMM sees ``M = 16 * tokens`` rows whatever the EP size.

For each (EP, tokens, layout of the rows over the experts), measured side by side:
* ``gate``: ``torch._grouped_mm`` ``[M, 3584] x [G, 3584, 3072]`` forward (``up`` is the same
  shape); ``down``: ``[M, 3072] x [G, 3072, 3584]``; each against ``[M, K] @ [K, N]``;
* ``expert``: the whole SiTU-GLU expert (``moe.experts.GroupedExperts``: gate, up, SiTU-GLU,
  down) forward+backward against the dense SiTU-GLU MLP of the same widths on the same M rows
  (``moe.experts.SiTUGLUMLP``), bf16 weights;
* ``1 group``: the gate GEMM with all M rows in one group, over dense: the grouped kernel's own
  rate apart from the split into groups.
TFLOP/s counts ``2 M K N`` per GEMM (times 3 for forward+backward); the ratio is
grouped over dense (target >= 0.85). Layouts: ``balanced`` (M/G rows each, M/G not a multiple
of 128 at these sizes), ``aligned`` (each count rounded down to a multiple of 128, the dense
GEMM on the same smaller M), ``skewed`` (log-normal loads, sigma 0.3: max/mean about 2). ``tile
waste`` is the share of 128-row tiles left empty by partial last tiles of the groups.

    python3 -m benchmarks.bench_grouped_experts --json OUT.json   # about 1.5 minutes on an H200
    python3 -m benchmarks.bench_grouped_experts --device cpu --small  # CPU dry run
"""
from __future__ import annotations

import argparse
import math
import warnings

import torch

from benchmarks.common import save_json, timeit  # noqa: E402

warnings.filterwarnings("ignore")

K3_EXPERTS, K3_TOPK, K3_LATENT, K3_FFN = 896, 16, 3584, 3072
LAYOUTS = ("balanced", "aligned", "skewed")


def expert_counts(rows: int, groups: int, layout: str, seed: int = 0) -> list[int]:
    """Rows per expert summing to ``rows`` (``aligned``: to at most ``rows``)."""
    if layout == "balanced":
        return [rows // groups + (g < rows % groups) for g in range(groups)]
    if layout == "aligned":
        return [rows // groups // 128 * 128] * groups
    gen = torch.Generator().manual_seed(seed)
    loads = torch.exp(torch.randn(groups, generator=gen, dtype=torch.float64) * 0.3)
    share = loads / loads.sum() * rows
    counts = share.floor().long()
    # Largest remainders take the rows that flooring left over.
    counts[torch.argsort(share - counts, descending=True)[: rows - int(counts.sum())]] += 1
    return counts.tolist()


def tile_waste(counts: list[int], tile: int = 128) -> float:
    """Empty share of the 128-row tiles that a tile-per-group kernel runs."""
    tiles = sum(math.ceil(c / tile) for c in counts)
    return 1.0 - sum(counts) / (tiles * tile) if tiles else 0.0


def bench_case(experts: int, tokens: int, layout: str, dims: tuple[int, int], dev: torch.device,
               dtype: torch.dtype, iters: int, shared: dict) -> dict:
    from moe.experts import GroupedExperts, SiTUGLUMLP

    latent, ffn = dims
    counts = expert_counts(tokens * K3_TOPK, experts, layout)
    m = sum(counts)
    timer = dict(warmup=2, iters=iters, device=dev.type)
    key = (experts, dims)
    if key not in shared:  # the expert weights of this EP size, built once
        shared.clear()
        with torch.device(dev):
            shared[key] = GroupedExperts(experts, latent, ffn).to(dtype)
    grouped = shared[key]
    with torch.device(dev):
        dense = SiTUGLUMLP(latent, ffn).to(dtype)
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(m, latent, device=dev, dtype=dtype)
    h = torch.randn(m, ffn, device=dev, dtype=dtype)
    wg, wd = grouped.w_gate.detach(), grouped.w_down.detach()
    wg0, wd0 = wg[0].contiguous(), wd[0].contiguous()
    ms = {
        "gate_grouped": timeit(lambda: torch._grouped_mm(x, wg, offs=offs), **timer),
        "gate_dense": timeit(lambda: x @ wg0, **timer),
        # All M rows in one group: the grouped kernel's own rate against cuBLAS, apart from
        # anything the split into groups costs.
        "gate1_grouped": timeit(lambda: torch._grouped_mm(x, wg[:1], offs=offs[-1:]), **timer),
        "down_grouped": timeit(lambda: torch._grouped_mm(h, wd, offs=offs), **timer),
        "down_dense": timeit(lambda: h @ wd0, **timer),
    }
    del h
    xg = x.requires_grad_()
    tpe = torch.tensor(counts, device=dev)
    dy = torch.randn(m, latent, device=dev, dtype=dtype)

    def fwd_bwd(module_call):
        def run():
            for p in (xg, *grouped.parameters(), *dense.parameters()):
                p.grad = None
            torch.autograd.backward(module_call(), dy)
        return run

    ms["expert_grouped"] = timeit(fwd_bwd(lambda: grouped(xg, tpe)), **timer)
    ms["expert_dense"] = timeit(fwd_bwd(lambda: dense(xg)), **timer)
    for p in (xg, *grouped.parameters(), *dense.parameters()):
        p.grad = None
    gemm = 2 * m * latent * ffn
    flops = {"gate": gemm, "gate1": gemm, "down": gemm, "expert": 3 * 3 * gemm}
    tflops = {name: flops[name.split("_")[0]] / (t * 1e-3) / 1e12 for name, t in ms.items()}
    return {"experts": experts, "ep": K3_EXPERTS // experts, "tokens": tokens, "layout": layout,
            "rows": m, "rows_per_expert": {"mean": m / experts, "min": min(counts), "max": max(counts)},
            "max_over_mean": max(counts) / (m / experts), "tile_waste": tile_waste(counts),
            "ms": ms, "tflops": tflops,
            "ratio": {p: ms[f"{p.rstrip('1')}_dense"] / ms[f"{p}_grouped"]
                      for p in ("gate", "gate1", "down", "expert")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny widths and counts (CPU dry run)")
    ap.add_argument("--ep", type=int, nargs="+", default=[8, 16],
                    help="expert-parallel sizes; the rank holds 896/EP experts (default 8 16)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536],
                    help="tokens per rank; the rank's experts see 16x as many rows")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible; use --device cpu --small")
    for ep in args.ep:
        if ep <= 0 or K3_EXPERTS % ep:
            ap.error(f"--ep {ep}: must divide K3's {K3_EXPERTS} experts (e.g. 8, 16, 32)")
    dev = torch.device(args.device)
    dims, dtype = ((64, 32), torch.float32) if args.small else ((K3_LATENT, K3_FFN), torch.bfloat16)
    if args.small:
        args.tokens = sorted({min(t, 1024) for t in args.tokens})
    if dev.type == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16
    torch.manual_seed(0)
    print(f"grouped experts, one EP rank's share of K3 (latent {dims[0]}, FFN {dims[1]}, "
          f"{dtype}); TFLOP/s grouped vs dense GEMM of the same FLOPs, side by side", flush=True)
    print(f"{'EP':>3} {'exp':>4} {'tokens':>6} {'layout':>8} {'rows/exp':>8} {'max/mean':>8} "
          f"{'waste':>6} | {'gate fwd TF/s':>15} {'ratio':>5} | {'down fwd TF/s':>15} {'ratio':>5} | "
          f"{'expert f+b TF/s':>15} {'ratio':>5} | {'1 group':>7}", flush=True)
    rows, shared = [], {}
    for ep in args.ep:
        for tokens in args.tokens:
            for layout in args.layouts:
                r = bench_case(K3_EXPERTS // ep, tokens, layout, dims, dev, dtype, args.iters, shared)
                rows.append(r)
                t = r["tflops"]
                cells = " | ".join(f"{t[p + '_grouped']:>6.0f} vs {t[p + '_dense']:>5.0f} {r['ratio'][p]:>5.2f}"
                                   for p in ("gate", "down", "expert"))
                print(f"{ep:>3} {r['experts']:>4} {tokens:>6} {layout:>8} "
                      f"{r['rows_per_expert']['mean']:>8.0f} {r['max_over_mean']:>8.2f} "
                      f"{r['tile_waste']:>6.1%} | {cells} | {r['ratio']['gate1']:>7.2f}", flush=True)
        shared.clear()
    worst = min(rows, key=lambda r: r["ratio"]["expert"])
    print(f"lowest expert fwd+bwd ratio: {worst['ratio']['expert']:.2f} (EP={worst['ep']}, "
          f"{worst['tokens']} tokens, {worst['layout']}); target >= 0.85")
    save_json(args.json, {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                          "dtype": str(dtype), "latent": dims[0], "ffn": dims[1], "rows": rows})


if __name__ == "__main__":
    main()
