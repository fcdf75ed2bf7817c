"""Muon's Newton-Schulz on one GPU: our Triton GEMM (reads C in its epilogue) against
torch.baddbmm (copies C into its output first), side by side on the same data.

    python scripts/bench/bench_muon.py [--json out.json]

Rows: one ``baddbmm`` of each Newton-Schulz kind on k3_mini's expert stack ``[512, 512, 512]``
bf16 (the Gram product, ``b A + c A A`` and ``a X + B X``), then the whole 5-step
``newton_schulz`` on each k3_mini Muon shape, with the relative difference between the two
backends and each one's error against an fp32 iteration.
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import graph_ms, save_json  # noqa: E402

import optim.muon as muon  # noqa: E402
from k3train import kernels  # noqa: E402
from optim.ns_gemm_triton import baddbmm_triton  # noqa: E402

# (stack size, rows, cols) of k3_mini's Muon batches: expert stacks, attention and dense FFN.
SHAPES = [(512, 512, 512), (32, 1024, 1024), (30, 1024, 2048), (15, 2048, 1024)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ns_with(backend: str, G: torch.Tensor) -> torch.Tensor:
    with kernels.using(ns_gemm=backend):
        return muon.newton_schulz(G)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    X = torch.randn(512, 512, 512, device="cuda", generator=gen).bfloat16() / 512
    A = X @ X.mT
    B = torch.baddbmm(A, A, A, beta=-4.775, alpha=2.0315)
    kinds = {"gram X X^T": (None, X, X.mT, 0.0, 1.0), "b A + c A A": (A, A, A, -4.775, 2.0315),
             "a X + B X": (X, B, X, 3.4445, 1.0)}
    print(f"{'one GEMM on [512, 512, 512] bf16':<36}{'torch us':>10}{'ours us':>10}{'ratio':>8}{'rel diff':>10}")
    for name, (c, a, b, beta, alpha) in kinds.items():
        def theirs():
            return torch.bmm(a, b) if c is None else torch.baddbmm(c, a, b, beta=beta, alpha=alpha)

        def ours():
            return baddbmm_triton(c, a, b, beta=beta, alpha=alpha)

        d = rel(ours(), theirs())
        t_torch, t_ours = graph_ms(theirs) * 1e3, graph_ms(ours) * 1e3
        out[name] = {"torch_us": t_torch, "ours_us": t_ours, "rel_diff": d}
        print(f"{name:<36}{t_torch:>10.1f}{t_ours:>10.1f}{t_torch / t_ours:>7.2f}x{d:>10.1e}")
    print(f"\n{'newton_schulz, 5 steps, bf16':<36}{'torch ms':>10}{'ours ms':>10}{'ratio':>8}"
          f"{'rel diff':>10}{'err torch':>10}{'err ours':>10}")
    for s, m, n in SHAPES:
        G = torch.randn(s, m, n, device="cuda", generator=gen)
        # fp32 reference: the same iteration with fp32 operands (torch's GEMMs).
        fp32 = _ns_fp32(G)
        a_t, a_o = ns_with("torch", G), ns_with("k3train", G)
        t_torch = graph_ms(lambda: ns_with("torch", G))
        t_ours = graph_ms(lambda: ns_with("k3train", G))
        row = {"torch_ms": t_torch, "ours_ms": t_ours, "rel_diff": rel(a_o, a_t),
               "err_torch": rel(a_t, fp32), "err_ours": rel(a_o, fp32)}
        out[f"ns {s}x{m}x{n}"] = row
        print(f"{f'[{s}, {m}, {n}]':<36}{t_torch:>10.2f}{t_ours:>10.2f}{t_torch / t_ours:>7.2f}x"
              f"{row['rel_diff']:>10.1e}{row['err_torch']:>10.1e}{row['err_ours']:>10.1e}")
    save_json(args.json, out)


def _ns_fp32(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The same quintic iteration in fp32 (reference for both bf16 backends)."""
    a, b, c = muon.NS_COEFFICIENTS
    X = G.float()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


if __name__ == "__main__":
    main()
