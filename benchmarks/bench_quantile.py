"""The router's two selections on one GPU at real router sizes, each checked, then timed against
its alternatives on the same data (device time replayed from a CUDA graph):

* the row top-k of ``scores + bias`` (the router's top-k and Quantile Balancing's top-(k+1)
  cutoff): our Triton kernel (``moe/topk_triton.py``, what runs on CUDA) against
  ``torch.topk``, with the ratio. Checked first: values and indices equal to a stable
  descending sort (ties to the lowest column), values equal to ``torch.topk``'s;
* the whole Quantile Balancing update (``moe.balancing.quantile_balance``) with the kernel and
  with ``torch.topk`` for the cutoff, checked bit for bit against a brute-force quantile
  (full sorts per token and per expert);
* the per-expert threshold alone: ``torch.kthvalue`` over the token dim (what
  ``quantile_balance`` runs, after a transpose) against topk and the untransposed form.

Shapes: ``E/k`` in ``--shapes`` (default k3_mini's 64/4, then 256/8, 384/8 and K3's 896/16) at
each of ``--tokens`` (default 16384 and 65536); bf16 scores (the router's under autocast) plus
an fp32 bias.

    python3 -m benchmarks.bench_quantile --json OUT.json          # about 1 minute on an H200
    python3 -m benchmarks.bench_quantile --tokens 16384 --shapes 896/16
    TRITON_INTERPRET=1 python3 -m benchmarks.bench_quantile --device cpu --tokens 64 --shapes 896/16
                                       # a dry run of this script on CPU: checks, no figures
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import graph_ms, save_json, timeit  # noqa: E402


def _device_us(fn, device: str) -> float:
    """Microseconds of ``fn()``: replayed from a CUDA graph on CUDA, wall time on CPU."""
    return (graph_ms(fn) if device == "cuda" else timeit(fn, warmup=1, iters=3, device="cpu")) * 1e3


def _shape(text: str) -> tuple[int, int]:
    try:
        e, k = (int(p) for p in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected EXPERTS/TOPK, e.g. 896/16")
    if not 0 < k < e:
        raise argparse.ArgumentTypeError(f"shape {text!r}: need 0 < TOPK < EXPERTS")
    return e, k


def _brute_force_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Quantile Balancing by its definition, with full sorts (docs/quantile_balancing.md)."""
    n, e = scores.shape
    s = scores.float()
    cutoff = torch.sort(s + bias, dim=1, descending=True).values[:, k:k + 1]
    threshold = torch.sort(s - cutoff, dim=0, descending=True).values[n * k // e]
    return -threshold - (-threshold).mean()


def check_topk(scores: torch.Tensor, bias: torch.Tensor, k: int) -> dict:
    from moe.topk_triton import row_topk_triton

    values, indices = row_topk_triton(scores, k, bias)
    keyed = scores + bias
    sv, si = torch.sort(keyed, dim=-1, descending=True, stable=True)
    ref = torch.topk(keyed, k, dim=-1)
    return {"values_equal_sort": bool(torch.equal(values, sv[:, :k])),
            "indices_equal_sort": bool(torch.equal(indices, si[:, :k])),
            "values_equal_torch_topk": bool(torch.equal(values, ref.values))}


def bench_case(n: int, e: int, k: int, device: str = "cuda") -> dict:
    from moe import backends as moe_backends
    from moe.balancing import quantile_balance
    from moe.topk_triton import row_topk_triton

    gen = torch.Generator(device=device).manual_seed(n + e + k)
    scores = torch.sigmoid(torch.randn(n, e, device=device, generator=gen)).bfloat16()
    bias = torch.randn(e, device=device, generator=gen) * 0.01
    row = {"tokens": n, "experts": e, "topk": k, "check": {}, "us": {}}
    for name, kk in (("router", k), ("cutoff", k + 1)):
        row["check"][f"{name}_top{kk}"] = check_topk(scores, bias, kk)
        t_torch = _device_us(lambda: torch.topk(scores + bias, kk, dim=-1), device)
        t_ours = _device_us(lambda: row_topk_triton(scores, kk, bias), device)
        row["us"][f"{name}_top{kk}_torch"], row["us"][f"{name}_top{kk}_ours"] = t_torch, t_ours
    want = _brute_force_bias(scores, bias, k)
    for backend in ("k3train", "torch"):
        previous = moe_backends.current()
        moe_backends.set_backends(moe_backends.Backends(router_topk=backend))
        try:
            got = quantile_balance(scores, bias, k)
            row["check"][f"qb_{backend}_equal_brute_force"] = bool(torch.equal(got, want))
            row["us"][f"qb_update_{backend}"] = _device_us(lambda: quantile_balance(scores, bias, k),
                                                           device)
        finally:
            moe_backends.set_backends(previous)
    q = n * k // e
    m = torch.randn(n, e, device=device, generator=gen)
    ways = {
        "kthvalue_dim0": lambda: torch.kthvalue(m, n - q, dim=0).values,
        "kthvalue_transposed": lambda: torch.kthvalue(m.t().contiguous(), n - q, dim=1).values,
        "topk_transposed": lambda: torch.topk(m.t().contiguous(), q + 1, dim=1).values[:, -1],
    }
    ref = ways["kthvalue_dim0"]()
    for name, fn in ways.items():
        row["check"][f"threshold_{name}_same"] = bool(torch.equal(fn(), ref))
        row["us"][f"threshold_{name}"] = _device_us(fn, device)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--shapes", type=_shape, nargs="+", default=[(64, 4), (256, 8), (384, 8), (896, 16)],
                    metavar="E/K", help="experts/top-k pairs (default 64/4 256/8 384/8 896/16)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run (run with TRITON_INTERPRET=1 for the kernel to run)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible; for a dry run use TRITON_INTERPRET=1 "
                 "with --device cpu --tokens 64")
    rows = []
    print(f"{'tokens':>7} {'E/k':>7} | {'top-k torch':>11} {'ours':>7} {'ratio':>6} | "
          f"{'top-k+1 torch':>13} {'ours':>7} {'ratio':>6} | {'QB ours':>8} {'QB torch':>8} | checks",
          flush=True)
    for n in args.tokens:
        for e, k in args.shapes:
            row = bench_case(n, e, k, args.device)
            rows.append(row)
            us = row["us"]
            r = row["ratio_router"] = us[f"router_top{k}_torch"] / us[f"router_top{k}_ours"]
            c = row["ratio_cutoff"] = us[f"cutoff_top{k + 1}_torch"] / us[f"cutoff_top{k + 1}_ours"]
            bad = [name for name, ok in row["check"].items() if not _all_true(ok)]
            print(f"{n:>7} {f'{e}/{k}':>7} | {us[f'router_top{k}_torch']:>9.1f}us "
                  f"{us[f'router_top{k}_ours']:>5.1f}us {r:>5.1f}x | "
                  f"{us[f'cutoff_top{k + 1}_torch']:>11.1f}us {us[f'cutoff_top{k + 1}_ours']:>5.1f}us "
                  f"{c:>5.1f}x | {us['qb_update_k3train']:>6.0f}us {us['qb_update_torch']:>6.0f}us | "
                  f"{'all pass' if not bad else 'FAILED: ' + ', '.join(bad)}", flush=True)
    failed = sum(not _all_true(ok) for row in rows for ok in row["check"].values())
    print(f"checks: {'all pass' if not failed else f'{failed} FAILED'}; QB = the whole Quantile "
          f"Balancing update (cutoff + margins + kthvalue threshold) with our top-k or torch.topk")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    save_json(args.json, {"device": name, "rows": rows,
                          "checks_failed": failed})
    if failed:
        sys.exit(1)


def _all_true(ok) -> bool:
    return all(ok.values()) if isinstance(ok, dict) else bool(ok)


if __name__ == "__main__":
    main()
