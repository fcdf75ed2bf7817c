"""The KDA context-parallel fold with the GPU kernel, on one device, against fp64.

One sequence cut into ``--chunks`` chunks, each run from a zero state by fla's ``chunk_kda``
(through ``k3train.ops.kda.kda``) at value width ``V + K`` (the fold's one call per chunk),
folded and corrected exactly as CP rank r does (``kda_chunks_folded``: the ranks' code with the
all-gather replaced by a stack). Reference: ``chunk_kda_torch`` over the whole sequence on the
CPU in fp64. Reported as relative L2 errors of the output and of the gradients of q, k, v, g,
beta, for the folded run and for the whole-sequence kernel call (the kernel's own rounding):

    python scripts/gpu_check_kda_cp.py [--seq-len 4096] [--chunks 2] [--json OUT]

fla's autotuners run ``--autotune fixed`` by default (one candidate per kernel, compiled ahead in
parallel): under ``full`` the two value widths' autotuning and compiles took more than 220 s on a
fresh H200 (2026-12-04), for a check whose figures do not depend on the tile choice.

Gate: every folded error below 1e-2 (fla's dots may run in tf32) and within 4x of the
whole-sequence call's error for the same quantity (or below 1e-4).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from k3train.ops import kernels
from k3train.ops.context_parallel import kda_chunks_folded
from k3train.ops.kda import kda, kda_backend
from k3train.ops.kda.chunk import chunk_kda_torch

NAMES = ["o", "dq", "dk", "dv", "dg", "dbeta"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(seq_len: int, heads: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    """fp64 CPU inputs at K3's gate bound: q, k unit rows, log-decay in (-5, 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = (F.normalize(r(1, seq_len, heads, dim), dim=-1) for _ in range(2))
    v = r(1, seq_len, heads, dim)
    g = -5.0 * torch.sigmoid(r(1, seq_len, heads, dim) - 3.0)
    beta = torch.sigmoid(r(1, seq_len, heads))
    return [q, k, v, g, beta]


def run(fn, xs: list[torch.Tensor], w: torch.Tensor) -> list[torch.Tensor]:
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    o = fn(*xs)
    grads = torch.autograd.grad((o.float() * w).sum(), xs)
    return [o.detach()] + [gr.detach() for gr in grads]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu only dry-runs the script (torch forms)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128, help="K = V per head")
    ap.add_argument("--autotune", default="fixed", choices=["fixed", "full"], help="kernels.autotune")
    ap.add_argument("--json", help="write the errors here")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    xs = inputs(args.seq_len, args.heads, args.dim)
    w = torch.randn(1, args.seq_len, args.heads, args.dim, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    ref = run(lambda *a: chunk_kda_torch(*a)[0], xs, w)
    on_dev = [x.float().to(dev) for x in xs]
    w_dev = w.float().to(dev)
    whole_fn = lambda *a: kda(*a)[0]  # noqa: E731
    folded_fn = lambda *a: kda_chunks_folded(*a, num_chunks=args.chunks, kernel=kda)  # noqa: E731
    with kernels.using(autotune=args.autotune):
        if dev.type == "cuda":  # every kernel of both runs compiled at once, in parallel
            from k3train.ops.triton_compile import compile_ahead
            compile_ahead(lambda: (run(whole_fn, on_dev, w_dev), run(folded_fn, on_dev, w_dev)),
                          label="the KDA fold check")
        whole = run(whole_fn, on_dev, w_dev)
        folded = run(folded_fn, on_dev, w_dev)
    report = {"backend": kda_backend(dev), "seq_len": args.seq_len, "chunks": args.chunks,
              "whole": {n: rel(a, b) for n, a, b in zip(NAMES, whole, ref)},
              "folded": {n: rel(a, b) for n, a, b in zip(NAMES, folded, ref)}}
    ok = all(report["folded"][n] < 1e-2 and report["folded"][n] <= max(4 * report["whole"][n], 1e-4)
             for n in NAMES)
    report["pass"] = ok
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
