"""Transformer Engine's float8 recipes on the K3 slice's fp8 GEMMs, side by side with
bf16 and with k3train's own float8 product (torchao's scaling, compiled), in one run:

    python3 -m benchmarks.bench_te_linear --json OUT/te_linear.json [--tokens 4096] [--iters 20]

The GEMMs are the ones ``precision.recipe=fp8`` converts in ``configs/k3_slice.yaml`` at top-1
(``k3train.quant.recipes.fp8_gemm_shapes`` on the model built on the meta device: attention
projections, latent projections, shared experts). Each shape runs forward and backward on
``--tokens`` rows (one microbatch of the slice) with fp32 master weights under bf16 autocast,
as the trainer runs them, in these variants:

* ``bf16``: ``nn.Linear``; ``ours_fp8``: the same through ``precision.recipe=fp8``'s conversion;
* ``te_bf16``: ``transformer_engine.pytorch.Linear`` without float8;
* ``te_delayed`` / ``te_current`` / ``te_block``: it under ``te.autocast`` with ``DelayedScaling``,
  ``Float8CurrentScaling`` and ``Float8BlockScaling``.

It prints per-shape times and the scope's total per microbatch (each shape's time x its module
count) with each variant's speed-up over ``bf16``, and each variant's output error against an
fp32 product. A variant that fails (a recipe this GPU or build lacks) is reported, not fatal.
Needs a CUDA GPU of compute capability >= 8.9, torchao, and Transformer Engine (on a lent GPU
machine ``tools/te_device.sh`` installs it).
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
from torch import nn

VARIANTS = ["bf16", "ours_fp8", "te_bf16", "te_delayed", "te_current", "te_block"]


def slice_shapes() -> dict[tuple[int, int], int]:
    """``{(in, out): modules}`` of the slice's fp8 scope at top-1 (bench_fp8's --preset slice)."""
    from k3train.config import load_config
    from k3train.runtime.distributed import init_distributed
    from k3train.model.model import build_model
    from k3train.quant.recipes import fp8_gemm_shapes

    init_distributed(device="cuda")
    cfg = load_config("configs/k3_slice.yaml", ["moe.topk=1"])
    with torch.device("meta"):
        model = build_model(cfg)
    return fp8_gemm_shapes(model, cfg.precision.model_copy(update={"recipe": "fp8"}))


def make(variant: str, in_f: int, out_f: int, weight: torch.Tensor):
    """(module, context factory) for one variant, holding a copy of ``weight`` [out, in] (fp32)."""
    if variant in ("bf16", "ours_fp8"):
        lin = nn.Linear(in_f, out_f, bias=False, device="cuda")
        lin.weight.data.copy_(weight)
        if variant == "ours_fp8":
            from k3train.quant.recipes import _apply_fp8

            holder = nn.Module()
            holder.lin = lin
            _apply_fp8(holder, {"lin": "lin"})
            lin = holder.lin
        return lin, contextlib.nullcontext
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    lin = te.Linear(in_f, out_f, bias=False, params_dtype=torch.float32, device="cuda")
    lin.weight.data.copy_(weight)
    if variant == "te_bf16":
        return lin, contextlib.nullcontext
    rec = {"te_delayed": te_recipe.DelayedScaling, "te_current": te_recipe.Float8CurrentScaling,
           "te_block": te_recipe.Float8BlockScaling}[variant]()
    return lin, lambda: te.autocast(enabled=True, recipe=rec)


def time_variant(variant: str, in_f: int, out_f: int, tokens: int, iters: int, warmup: int = 5) -> dict:
    """Forward+backward ms per call (the mean over ``iters`` after ``warmup``) and the
    output's error relative to an fp32 product of the same bf16-rounded operands."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(out_f, in_f, device="cuda", generator=gen) / in_f ** 0.5
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dy = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16, generator=gen)
    mod, ctx = make(variant, in_f, out_f, weight)

    def call():
        with torch.autocast("cuda", dtype=torch.bfloat16), ctx():
            y = mod(x)
        y.backward(dy)
        return y

    for _ in range(warmup):
        y = call()
    ref = x.detach().float() @ weight.to(torch.bfloat16).float().t()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return {"ms": start.elapsed_time(end) / iters, "rel_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, default=4096, help="rows per GEMM (one slice microbatch)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_te_linear needs a CUDA GPU")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed: {','.join(VARIANTS)}")
    shapes = slice_shapes()
    rows, errors = [], {}
    for (in_f, out_f), count in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[1]):
        row = {"in": in_f, "out": out_f, "modules": count}
        for v in variants:
            if v in errors:
                continue
            try:
                row[v] = time_variant(v, in_f, out_f, args.tokens, args.iters)
            except Exception as exc:  # noqa: BLE001 - a recipe this GPU or build lacks: report it
                errors[v] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(f"{in_f:>6} x {out_f:<6} x{count:<3}" + "".join(
            f"  {v} {row[v]['ms']:7.3f} ms" for v in variants if v in row), flush=True)
    totals = {v: sum(r[v]["ms"] * r["modules"] for r in rows) for v in variants if v not in errors}
    print(f"\nthe slice's fp8 scope, forward+backward per microbatch of {args.tokens} tokens "
          f"({sum(shapes.values())} modules, {len(shapes)} shapes):")
    for v, ms in totals.items():
        worst = max(r[v]["rel_err"] for r in rows)
        print(f"  {v:<11} {ms:8.2f} ms   {totals['bf16'] / ms if 'bf16' in totals else float('nan'):5.2f}x vs bf16"
              f"   output rel err <= {worst:.1e}")
    for v, e in errors.items():
        print(f"  {v:<11} failed: {e}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
            "iters": args.iters}
    try:
        import transformer_engine

        meta["transformer_engine"] = getattr(transformer_engine, "__version__", "unknown")
    except ImportError as exc:
        meta["transformer_engine"] = f"not importable: {exc}"
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows, "totals_ms": totals, "errors": errors}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
