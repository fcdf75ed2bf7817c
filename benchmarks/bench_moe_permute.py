"""The fused MoE permutation on one GPU: speed against a plain copy, and the GPU checks.

    python3 -m benchmarks.bench_moe_permute --json permute.json          # timing (~1 min)
    python3 -m benchmarks.bench_moe_permute --check --json check.json    # checks (~1 min)

Timing (EP=1, no all-to-all), bf16, at k3_mini's shape (16384 tokens x top-4 x latent 512, 64
experts) and K3's (16384 x top-16 x latent 3584, 896 experts), static capacity 1.25:

* ``kernel``: ``dispatch_rows`` + ``combine_rows`` forward on the dispatcher's maps, torch form
  and Triton form, next to the copy floor: two ``copy_`` of an ``[M, d]`` tensor (M = buffer
  rows), i.e. the buffer bytes dispatch writes and combine reads, each read and written once.
  ``vs copy`` = time / copy time (target <= 1.3).
* ``kernel fwd+bwd``: the same with both backwards (torch vs Triton; no copy floor).
* ``dispatcher``: ``GroupedAllToAllDispatcher.dispatch`` + ``combine`` forward (sort, slot
  positions and the row passes), dynamic and static, torch vs Triton; ``host reads`` per call.

Checks (``--check``; each prints ok/FAIL, exit status 1 on any FAIL):

1. Triton vs torch form through the static dispatcher with dropped slots (c=0.5) and through
   the dynamic one, fp32 and bf16: buffer bit for bit, combine output, and the gradients of
   the tokens, the expert outputs and the routing weights (fp32: 1e-5; bf16: one bf16 ulp).
2. Static with a capacity that drops nothing (c = E/k) == dynamic: a fp32 LatentMoE layer's
   output and every gradient (rtol=atol=1e-4: the grouped GEMMs see padded blocks).
3. CUDA graph: a bf16 static-mode LatentMoE layer's forward and backward captured in one
   ``torch.cuda.CUDAGraph``, replayed on new tokens: output, input and parameter gradients and
   the dropped-slot count equal an eager pass on the same tokens (bf16: 1e-2), and the eager
   static step makes no host read.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


from k3train.ops import kernels  # noqa: E402
from moe import GroupedAllToAllDispatcher, LatentMoE  # noqa: E402
from benchmarks.host_reads import count_host_reads  # noqa: E402
from moe.dispatch_a2a import all_to_all_rows  # noqa: E402
from moe.permute_fused import combine_rows, dispatch_rows  # noqa: E402
from benchmarks.common import timeit  # noqa: E402

SHAPES = {"k3_mini": dict(tokens=16384, topk=4, d=512, experts=64),
          "k3": dict(tokens=16384, topk=16, d=3584, experts=896)}
BACKENDS = ("torch", "k3train")


def _routing(n, k, e, seed=0, dev="cuda"):
    """Balanced random routing: indices ``[n, k]`` (distinct per token), fp32 weights ``[n, k]``."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    scores = torch.rand(n, e, device=dev, generator=gen)
    w, idx = scores.topk(k, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).float()


def bench(args) -> dict:
    out = {}
    for name, s in SHAPES.items():
        n, k, d, e = s["tokens"], s["topk"], s["d"], s["experts"]
        idx, w = _routing(n, k, e)
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        rows = {}
        for mode, cf in (("dynamic", None), ("static", args.capacity_factor)):
            disp = GroupedAllToAllDispatcher(e, capacity_factor=cf)
            for be in BACKENDS:
                with kernels.using(moe_permute=be):
                    def step():
                        xs, _, st = disp.dispatch(x, idx, w)
                        return disp.combine(xs, st)
                    with count_host_reads() as reads:
                        step()
                    rows[f"dispatcher {mode} {be}"] = dict(ms=timeit(step, args.warmup, args.iters),
                                                           host_reads=reads[0])
        # The kernels alone, on the static dispatcher's maps.
        disp = GroupedAllToAllDispatcher(e, capacity_factor=args.capacity_factor)
        xs, _, st = disp.dispatch(x, idx, w)
        m = xs.shape[0]
        y = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        src, dst = torch.empty_like(y), torch.empty_like(y)

        def copies():
            dst.copy_(src)
            src.copy_(dst)
        rows["copy floor"] = dict(ms=timeit(copies, args.warmup, args.iters))
        for be in BACKENDS:
            with kernels.using(moe_permute=be):
                fwd = lambda: (dispatch_rows(x, st.row_of_slot, st.slot_of_row, k),  # noqa: E731
                               combine_rows(y, st.row_of_slot, st.slot_of_row, w))
                rows[f"kernel {be}"] = dict(ms=timeit(fwd, args.warmup, args.iters))
                xg, yg, wg = (t.detach().clone().requires_grad_(True) for t in (x, y, w))
                gd, gc = torch.randn_like(y), torch.randn_like(x)

                def fwd_bwd():
                    a = dispatch_rows(xg, st.row_of_slot, st.slot_of_row, k)
                    b = combine_rows(yg, st.row_of_slot, st.slot_of_row, wg)
                    torch.autograd.grad([a, b], [xg, yg, wg], [gd, gc])   # no accumulation
                rows[f"kernel fwd+bwd {be}"] = dict(ms=timeit(fwd_bwd, args.warmup, args.iters))
        copy_ms = rows["copy floor"]["ms"]
        for key in ("kernel torch", "kernel k3train"):
            rows[key]["vs_copy"] = rows[key]["ms"] / copy_ms
        rows["copy floor"]["gb_per_s"] = 4 * y.numel() * y.element_size() / copy_ms / 1e6
        ms = {key: r["ms"] for key, r in rows.items()}
        ratios = {"triton_vs_copy": rows["kernel k3train"]["vs_copy"],
                  "torch_vs_copy": rows["kernel torch"]["vs_copy"],
                  "triton_vs_torch_fwd": ms["kernel k3train"] / ms["kernel torch"],
                  "triton_vs_torch_fwd_bwd": ms["kernel fwd+bwd k3train"] / ms["kernel fwd+bwd torch"],
                  "static_vs_dynamic_triton": ms["dispatcher static k3train"] / ms["dispatcher dynamic k3train"]}
        out[name] = dict(shape=dict(s, rows=m, capacity_factor=args.capacity_factor), rows=rows,
                         ratios=ratios)
        print(f"\n{name}: N={n} k={k} d={d} E={e} buffer rows M={m} "
              f"(static c={args.capacity_factor}), bf16")
        print(f"  {'what':34s} {'ms':>9s} {'vs copy':>8s} {'host reads':>10s}")
        for key, r in rows.items():
            vc = f"{r['vs_copy']:.2f}" if "vs_copy" in r else ""
            hr = str(r["host_reads"]) if "host_reads" in r else ""
            print(f"  {key:34s} {r['ms']:9.3f} {vc:>8s} {hr:>10s}")
        print("  ratios: " + ", ".join(f"{k_}={v:.2f}" for k_, v in ratios.items()))
        torch.cuda.empty_cache()
    return out


def _close(a, b, bf16_ok: bool) -> bool:
    if a.dtype == torch.bfloat16 and bf16_ok:
        return torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-3)
    return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5)


def check_kernels(dev="cuda") -> list[tuple[str, bool]]:
    """Triton == torch form through the dispatcher: the buffer bit for bit, the combine output
    and the gradients of tokens, expert outputs and weights within the test tolerances."""
    results = []
    n, k, e, d = 1000, 4, 16, 200
    for dtype in (torch.float32, torch.bfloat16):
        idx, w = _routing(n, k, e, seed=1, dev=dev)
        gen = torch.Generator(dev).manual_seed(2)
        x, scale, g_out = (torch.randn(shape, device=dev, generator=gen).to(dtype)
                           for shape in ((n, d), (d,), (n, d)))
        for cf in (None, 0.5):
            got = {}
            for be in BACKENDS:
                with kernels.using(moe_permute=be):
                    disp = GroupedAllToAllDispatcher(e, capacity_factor=cf)
                    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                    xs, _, st = disp.dispatch(xi, idx, wi)
                    ys = (xs * scale).detach().requires_grad_(True)     # stand-in experts
                    out = disp.combine(ys, st)
                    g_buf = torch.randn(xs.shape, device=dev, generator=torch.Generator(dev).manual_seed(3))
                    torch.autograd.backward([out, xs], [g_out, g_buf.to(dtype)])
                    got[be] = (xs.detach(), out.detach(), xi.grad, ys.grad, wi.grad,
                               int(st.dropped))
            t, f = got["torch"], got["k3train"]
            ok = (torch.equal(t[0], f[0]) and t[5] == f[5]
                  and all(_close(a, b, True) for a, b in zip(f[1:5], t[1:5])))
            mode = "dynamic" if cf is None else f"static c={cf} (dropped {t[5]})"
            results.append((f"triton == torch form, {str(dtype)[6:]}, {mode}", ok))
    return results


def _layer(cf, dtype, e=16, k=4, dev="cuda"):
    torch.manual_seed(0)
    moe = LatentMoE(hidden_size=256, latent_size=128, num_experts=e, topk=k, expert_ffn_size=128,
                    num_shared_experts=1, shared_ffn_size=128, init_std=0.05,
                    dispatcher=GroupedAllToAllDispatcher(e, capacity_factor=cf))
    return moe.to(device=dev, dtype=dtype)


def check_static_equals_dynamic(dev="cuda") -> list[tuple[str, bool]]:
    x = torch.randn(512, 256, device=dev)
    res = []
    for cf in (None, 16 / 4):
        moe = _layer(cf, torch.float32, dev=dev)
        xi = x.clone().requires_grad_(True)
        y = moe(xi)
        (y * torch.linspace(-1, 1, y.numel(), device=dev).view_as(y)).sum().backward()
        res.append((y.detach(), xi.grad, [p.grad for p in moe.parameters()], int(moe.routing.last_dropped)))
    (yd, dxd, gd, _), (ys, dxs, gs, drop) = res
    tol = dict(rtol=1e-4, atol=1e-4)
    ok = (drop == 0 and torch.allclose(ys, yd, **tol) and torch.allclose(dxs, dxd, **tol)
          and all(torch.allclose(a, b, **tol) for a, b in zip(gs, gd)))
    return [("static (c=E/k, 0 dropped) == dynamic, fp32 LatentMoE output and all grads", ok)]


def check_cuda_graph(nccl_group=None) -> list[tuple[str, bool]]:
    """nccl_group: a one-rank NCCL group whose ``all_to_all_single`` every exchange of the static
    dispatcher runs through (at EP=1 the dispatcher skips the exchange: here it is forced), so
    the capture records the expert-parallel collective as an EP>1 rank's graph does."""
    moe = _layer(1.0, torch.bfloat16)
    if nccl_group is not None:
        moe.dispatcher._exchange = (lambda x, rows, out_s, in_s:
                                    all_to_all_rows(x, rows, out_s, in_s, nccl_group))
    static_x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    static_g = torch.randn_like(static_x)

    def fwd_bwd():
        y = moe(static_x.requires_grad_(True))
        y.backward(static_g)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fwd_bwd()
            moe.zero_grad(set_to_none=True)
            static_x.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fwd_bwd()
    captured = [p.grad for p in moe.parameters()], static_x.grad, moe.routing.last_dropped

    new_x = torch.randn_like(static_x)
    with torch.no_grad():
        static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    grads = [g.clone() for g in captured[0]]
    dx, y_graph, dropped_graph = captured[1].clone(), static_y.clone(), int(captured[2])

    def eager():
        moe.zero_grad(set_to_none=True)
        xe = new_x.clone().requires_grad_(True)
        ye = moe(xe)
        ye.backward(static_g)
        return ye, xe

    eager()  # untimed and uncounted: a compile or recompile on this path reads the host itself
    # GPU-tensor reads only: the compiled pieces' generated code reads its CPU scalar arguments
    # (.item() on a CPU tensor, no device sync; the capture above would have failed on a sync).
    with count_host_reads(device_only=True) as reads:
        ye, xe = eager()
    tol = dict(rtol=1e-2, atol=1e-2)
    pairs = {"y": (y_graph, ye), "dx": (dx, xe.grad),
             **{f"grad.{n}": (a, p.grad) for a, (n, p) in zip(grads, moe.named_parameters())}}
    worst = {k: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
             for k, (a, b) in pairs.items()}
    bad = sorted((k for k, (a, b) in pairs.items() if not torch.allclose(a.float(), b.float(), **tol)),
                 key=lambda k: -worst[k])
    ok = reads[0] == 0 and dropped_graph == int(moe.routing.last_dropped) and not bad
    why = f"; differ: {', '.join(f'{k} {worst[k]:.1e}' for k in bad[:4])}" if bad else ""
    why += f"; reads at {sorted(set(reads[1:]))}" if reads[0] else ""
    where = " with its all-to-all on a one-rank NCCL group" if nccl_group is not None else ""
    return [(f"CUDA graph replay of a static LatentMoE fwd+bwd{where} == eager (dropped {dropped_graph} vs "
             f"{int(moe.routing.last_dropped)}, eager host reads {reads[0]}{why})", ok)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="run the GPU checks instead of timing")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_permute needs a CUDA GPU (the CPU path is tested by tests/moe/test_permute_fused.py)")
        return 2
    if args.check:
        results = check_kernels() + check_static_equals_dynamic() + check_cuda_graph()
        # The same capture with the all-to-all inside the graph, on a one-rank NCCL group.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
        results += check_cuda_graph(torch.distributed.new_group([0]))
        torch.distributed.destroy_process_group()
        for name, ok in results:
            print(f"{'ok  ' if ok else 'FAIL'} {name}")
        out = {"checks": [{"name": n, "ok": ok} for n, ok in results]}
        status = 0 if all(ok for _, ok in results) else 1
    else:
        out, status = bench(args), 0
    out["device"] = torch.cuda.get_device_name()
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
