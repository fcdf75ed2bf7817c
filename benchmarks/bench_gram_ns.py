"""Gram Newton-Schulz against the standard iteration on one GPU, in bf16 as Muon runs them.

    python3 -m benchmarks.bench_gram_ns [--json out.json]

Per shape (the slice's per-head q/k/v stack ``[96, 128, 7168]``, its ``[576, 7168]`` matrix,
and a near-square expert ``[8, 3584, 3072]`` where auto keeps the standard form), two inputs
(Gaussian, and singular values ``k^-1.5`` like a momentum's), each ns_gemm backend (ours,
torch): the measured time of ``newton_schulz(mode=standard)`` and ``mode=gram``, and each one's
relative error against the fp64 map (the standard iteration in fp64) with its singular-value
range. PASS where, on every row with auto = gram, the Gram error is at most 1.5x the standard
error and its singular values lie within 0.06 of the fp64 band (the CPU test's bounds,
tests/optim/test_ns_gram.py); then ``optim.muon_ns=auto`` may become the default.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import save_json, timeit
from k3train.ops import kernels
from optim import newton_schulz
from optim.ns_gram import use_gram

SHAPES = [(96, 128, 7168), (1, 576, 7168), (8, 3584, 3072)]


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y).norm() / y.norm()).item()


def decaying(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """fp64 matrices of ``shape`` with singular values ``k^-1.5`` (orthonormal factors)."""
    s, a, b = shape
    k = min(a, b)
    U = torch.linalg.qr(torch.randn(s, a, k, dtype=torch.float64, device="cuda", generator=gen))[0]
    V = torch.linalg.qr(torch.randn(s, b, k, dtype=torch.float64, device="cuda", generator=gen))[0]
    sv = torch.arange(1, k + 1, dtype=torch.float64, device="cuda") ** -1.5
    return U @ torch.diag_embed(sv) @ V.mT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, ok = [], True
    print(f"{'shape':<18}{'input':<10}{'gemm':<9}{'auto':<9}{'std ms':>8}{'gram ms':>9}{'std err':>9}"
          f"{'gram err':>10}{'fp64 band':>16}{'gram band':>16}")
    for shape in SHAPES:
        for kind in ("gaussian", "decaying"):
            G = (torch.randn(*shape, dtype=torch.float64, device="cuda", generator=gen) if kind == "gaussian"
                 else decaying(shape, gen))
            ref = newton_schulz(G)  # fp64 stays fp64: the map itself
            band = torch.linalg.svdvals(ref)
            Gb = G.float()
            auto = "gram" if use_gram("auto", *sorted(shape[1:])) else "standard"
            for backend in ("k3train", "torch"):
                with kernels.using(ns_gemm=backend):
                    std, gram = newton_schulz(Gb), newton_schulz(Gb, mode="gram")
                    t_std = timeit(lambda: newton_schulz(Gb), warmup=2, iters=5)
                    t_gram = timeit(lambda: newton_schulz(Gb, mode="gram"), warmup=2, iters=5)
                sv = torch.linalg.svdvals(gram.double())
                row = {"shape": list(shape), "input": kind, "ns_gemm": backend, "auto": auto,
                       "standard_ms": t_std, "gram_ms": t_gram, "standard_err": rel(std, ref),
                       "gram_err": rel(gram, ref), "band": [band.min().item(), band.max().item()],
                       "gram_band": [sv.min().item(), sv.max().item()]}
                if auto == "gram":
                    row["pass"] = bool(row["gram_err"] <= 1.5 * row["standard_err"]
                                       and band.min() - 0.06 <= sv.min() and sv.max() <= band.max() + 0.06)
                    ok &= bool(row["pass"])
                rows.append(row)
                print(f"{str(list(shape)):<18}{kind:<10}{backend:<9}{auto:<9}{t_std:>8.2f}{t_gram:>9.2f}"
                      f"{row['standard_err']:>9.2e}{row['gram_err']:>10.2e}"
                      f"{'[%.3f, %.3f]' % tuple(row['band']):>16}{'[%.3f, %.3f]' % tuple(row['gram_band']):>16}")
            del G, Gb, ref
    print("PASS" if ok else "FAIL", "(Gram error <= 1.5x standard and band within 0.06 on auto's Gram shapes)")
    save_json(args.json, {"device": torch.cuda.get_device_name(), "rows": rows, "pass": ok})


if __name__ == "__main__":
    main()
