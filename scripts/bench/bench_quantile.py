"""Quantile Balancing's per-expert threshold on one GPU: ``torch.kthvalue`` over the token dim
(what ``moe.balancing.quantile_balance`` runs) against the alternatives, same data, same result.

    python scripts/bench/bench_quantile.py [--tokens 16384 --experts 64 --topk 4]
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import graph_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=4)
    args = ap.parse_args()
    n, e = args.tokens, args.experts
    q = n * args.topk // e
    m = torch.randn(n, e, device="cuda")
    ways = {
        "kthvalue_dim0": lambda: torch.kthvalue(m, n - q, dim=0).values,
        "kthvalue_transposed": lambda: torch.kthvalue(m.t().contiguous(), n - q, dim=1).values,
        "topk_dim0": lambda: torch.topk(m, q + 1, dim=0).values[-1],
        "topk_transposed": lambda: torch.topk(m.t().contiguous(), q + 1, dim=1).values[:, -1],
    }
    ref = ways["kthvalue_dim0"]()
    for name, fn in ways.items():
        same = torch.equal(fn(), ref)
        print(f"{name:<22}{graph_ms(fn) * 1e3:>9.1f} us   same result: {same}")


if __name__ == "__main__":
    main()
