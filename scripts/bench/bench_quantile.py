"""The router's two selections on one GPU, each against its alternatives on the same data:

* Quantile Balancing's per-expert threshold: ``torch.kthvalue`` over the token dim (what
  ``moe.balancing.quantile_balance`` runs) against topk and the untransposed form;
* the row top-k of ``scores + bias`` (router top-k, balancing cutoff): our Triton kernel
  (``moe/topk_triton.py``, what runs on CUDA) against ``torch.topk``, with the ratio.

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

    from moe.topk_triton import row_topk_triton

    scores = torch.rand(n, e, device="cuda").bfloat16()
    bias = torch.randn(e, device="cuda") * 0.01
    for k in (args.topk, args.topk + 1):
        ref = torch.topk(scores + bias, k, dim=-1)
        ours = row_topk_triton(scores, k, bias)
        t_torch = graph_ms(lambda: torch.topk(scores + bias, k, dim=-1))
        t_ours = graph_ms(lambda: row_topk_triton(scores, k, bias))
        print(f"row top-{k} of [{n}, {e}] bf16 + fp32 bias: torch.topk {t_torch * 1e3:.1f} us, "
              f"ours {t_ours * 1e3:.1f} us ({t_torch / t_ours:.1f}x); same values: "
              f"{torch.equal(ours[0], ref.values)}")


if __name__ == "__main__":
    main()
