"""Where a LatentMoE layer's time goes on one device: router, permutation, experts, the rest.

    python3 -m benchmarks.bench_moe_layer [--json OUT]          # one GPU, k3_mini's MoE shape
    python3 -m benchmarks.bench_moe_layer --device cpu --small  # CPU dry run

Forward+backward, each timed alone on the inputs it sees inside the layer, next to the whole
layer in the same run (bf16 autocast over fp32 weights on CUDA, as the trainer runs; fp32 on
CPU):
* ``layer``: ``LatentMoE`` as the trainer builds it (local dispatcher);
* ``router``: sigmoid scores, selection-bias top-k and renormalised weights;
* ``permute``: ``LocalDispatcher.dispatch`` + ``combine`` with identity experts in between
  (sort by expert, gather into expert order, weighted scatter back);
* ``experts`` (one ``torch._grouped_mm`` per projection) and ``experts_loop`` (one matmul per
  expert, the fallback), on the permuted batch;
* ``latent``: the down projection, the RMSNorm and the up projection; ``shared``: the shared
  expert.
Prints ms and share of the layer for each, the sum of the parts, and grouped over loop; on
CUDA also each part's device time replayed from a CUDA graph (``graph ms``).

``--shape k3``: K3's MoE layer (hidden 7168, 896 experts top-16, latent 3584, expert FFN 3072,
two shared experts of 3072 on the full width) at 16K, 32K and 64K tokens, one expert-parallel
rank's share of it run locally: ``FoldedDispatcher`` (below) gives the rank's 896/``--ep``
experts the ``16 * tokens`` rows a rank receives under balanced EP, without the all-to-all.
After one Quantile Balancing update (the loads the trainer sees) it times, forward+backward,
``layer``, ``router``, ``permute``, ``experts``, ``latent`` and ``shared`` as above, and without
gradients ``qb_cutoff`` (Quantile Balancing's top-(k+1) and margins) and ``qb_update`` (the
whole update, thresholds included); it prints router + QB cutoff over the grouped experts
(target <= 10%). About 2 minutes on an H200:

    python3 -m benchmarks.bench_moe_layer --shape k3 --json OUT
    python3 -m benchmarks.bench_moe_layer --shape k3 --device cpu --small  # CPU dry run
"""
from __future__ import annotations

import argparse
import warnings

import torch

from benchmarks.common import graph_ms, profile_table, save_json, timeit  # noqa: E402

from moe.dispatch import LocalDispatcher  # noqa: E402

warnings.filterwarnings("ignore")


K3 = dict(hidden=7168, latent=3584, experts=896, topk=16, expert_ffn=3072, shared_experts=2,
          shared_ffn=3072)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="mini", choices=["mini", "k3"],
                    help="mini: k3_mini's MoE layer (the widths below); k3: K3's (module docstring)")
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU dry run)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="tokens per layer call (mini: 16384 = k3_mini's 8 x 2048; k3: 16384 32768 65536)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--shared-ffn", type=int, default=2048)
    ap.add_argument("--ep", type=int, default=8, help="k3: the EP size whose one rank's share runs here")
    ap.add_argument("--iters", type=int, default=5, help="k3: timed iterations per part (after 2 warmup)")
    ap.add_argument("--profile", action="store_true", help="print the top operators of the layer")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.shared_experts = 1
    if args.shape == "k3":
        for name, value in K3.items():
            setattr(args, name, value)
        if args.experts % args.ep:
            ap.error(f"--ep {args.ep}: must divide K3's {args.experts} experts (e.g. 8, 16)")
    if args.small:
        args.hidden, args.latent, args.expert_ffn, args.shared_ffn = 64, 32, 32, 64
        args.experts, args.topk = (32, 4) if args.shape == "k3" else (8, min(args.topk, 2))
        args.tokens = [256]
    if args.tokens is None:
        args.tokens = [16384, 32768, 65536] if args.shape == "k3" else [16384]
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible; use --device cpu --small")
    if args.shape == "mini":
        results = [run_mini(args, tokens) for tokens in args.tokens]
        save_json(args.json, results[0] if len(results) == 1 else {"rows": results})
    else:
        rows = [run_k3(args, tokens) for tokens in args.tokens]
        print_k3_summary(rows)
        save_json(args.json, {"device": rows[0]["device"], "shape": "k3", "rows": rows})


def _fwd_bwd(fn, autocast):
    """fn returns a tensor or a tuple of tensors; one backward through all of them."""
    def run():
        with autocast:
            outs = fn()
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum(o.float().square().mean() for o in outs).backward()
    return run


def run_mini(args, tokens: int) -> dict:
    from moe import LatentMoE

    dev = torch.device(args.device)
    torch.manual_seed(0)
    layer = LatentMoE(hidden_size=args.hidden, latent_size=args.latent, num_experts=args.experts,
                      topk=args.topk, expert_ffn_size=args.expert_ffn, num_shared_experts=1, shared_ffn_size=args.shared_ffn).to(dev)
    # No weight-cast cache: the CUDA-graph timings below record the casts, as train.cuda_graph does.
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda", cache_enabled=False)
    x = torch.randn(tokens, args.hidden, device=dev, requires_grad=True)

    def fwd_bwd(fn):
        return _fwd_bwd(fn, autocast)
    # The inputs each part sees inside the layer, computed once (detached leaves).
    with torch.no_grad(), autocast:
        routing = layer.router(x)
        latent = layer.down(x)
        x_sorted, counts, _ = layer.dispatcher.dispatch(latent, routing.indices, routing.weights)
        routed = layer.dispatcher.combine(layer.experts(x_sorted, counts), _)
    latent, x_sorted, routed = (t.detach().requires_grad_() for t in (latent, x_sorted, routed))
    weights = routing.weights.detach().requires_grad_()

    def permute():
        xs, _counts, state = layer.dispatcher.dispatch(latent, routing.indices, weights)
        return layer.dispatcher.combine(xs, state)

    from moe.permute import weighted_sum, weighted_sum_eager

    with torch.no_grad(), autocast:
        slots = layer.experts(x_sorted, counts)  # [N*k, latent] expert outputs, as combine sees them
    slots = slots.detach().requires_grad_()
    parts = {
        "layer": lambda: layer(x),
        "router": lambda: layer.router(x).weights,
        "permute": permute,
        "experts": lambda: layer.experts(x_sorted, counts),
        "experts_loop": lambda: layer.experts.forward_loop(x_sorted, counts),
        "latent": lambda: (layer.down(x), layer.up(layer.norm(routed))),
        "shared": lambda: layer.shared(x),
        # The weighted k-way sum of combine alone, compiled (as the layer runs it) and eager.
        "combine_sum": lambda: weighted_sum(slots, weights),
        "combine_sum_eager": lambda: weighted_sum_eager(slots, weights),
    }
    times = {name: timeit(fwd_bwd(fn), warmup=3, iters=10, device=dev.type) for name, fn in parts.items()}
    # Device time alone (replayed from a CUDA graph, as train.cuda_graph runs the step): eager
    # timings of these small kernels also count the host's launch cost. The loop reads counts on
    # the host, which a graph cannot, so it has no graphed figure.
    graphed = ({name: graph_ms(fwd_bwd(fn)) for name, fn in parts.items() if name != "experts_loop"}
               if dev.type == "cuda" else {})
    total = times["layer"]
    not_parts = ("layer", "experts_loop", "combine_sum", "combine_sum_eager")  # the sum is inside permute
    summed = sum(v for k, v in times.items() if k not in not_parts)
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "shape": dict(vars(args), tokens=tokens), "ms": times, "share_of_layer": {k: v / total for k, v in times.items()},
              "sum_of_parts_ms": summed, "grouped_over_loop": times["experts_loop"] / times["experts"],
              "graph_ms": graphed}
    if graphed:
        result["graph_sum_of_parts_ms"] = sum(v for k, v in graphed.items() if k not in not_parts)
    print(f"LatentMoE fwd+bwd, {tokens} tokens, d={args.hidden} latent={args.latent} "
          f"E={args.experts} top-{args.topk} ffn={args.expert_ffn} shared={args.shared_ffn} ({result['device']})")
    print(f"{'part':<14}{'ms':>10}{'of layer':>10}{'graph ms':>10}")
    for name, ms in times.items():
        g = f"{graphed[name]:>10.3f}" if name in graphed else ""
        print(f"{name:<14}{ms:>10.3f}{ms / total:>10.1%}{g}")
    print(f"{'sum of parts':<14}{summed:>10.3f}{summed / total:>10.1%}   (without experts_loop)")
    print(f"grouped experts {result['grouped_over_loop']:.2f}x faster than the per-expert loop")
    if args.profile:
        print(profile_table(fwd_bwd(parts["layer"]), device=dev.type), flush=True)
    return result


class FoldedDispatcher(LocalDispatcher):
    """One expert-parallel rank's expert compute with the all-to-all left out.

    Routes over all ``num_experts`` and sorts by expert as ``LocalDispatcher`` does, then counts
    global experts ``[j * ep, (j + 1) * ep)`` as local expert ``j`` (they are contiguous in the
    sorted rows). The rank's ``num_experts / ep`` experts thus see ``N * k`` rows, what a rank
    receives under balanced EP (each of the ep ranks sends it ``N * k / ep`` rows); each local
    expert's load is the sum of ep global experts' loads over this rank's tokens, where under EP
    it is one global expert's load over every rank's tokens (the same mean)."""

    def __init__(self, num_experts: int, ep: int):
        super().__init__(num_experts)
        self.ep = ep
        self.num_local_experts = num_experts // ep

    def dispatch(self, x, indices, weights):
        x_sorted, counts, state = super().dispatch(x, indices, weights)
        return x_sorted, counts.view(self.num_local_experts, self.ep).sum(dim=1), state


def run_k3(args, tokens: int) -> dict:
    """K3's MoE layer, one EP rank's share (``FoldedDispatcher``), forward+backward by part."""
    from moe import LatentMoE, quantile_balance
    from moe.balancing import _margins

    dev = torch.device(args.device)
    torch.manual_seed(0)
    # Built on the device: the expert init draws all 896 experts' weights once (39 GB in fp32
    # on GPU, minutes on a CPU) and keeps this rank's share.
    with dev:
        layer = LatentMoE(hidden_size=args.hidden, latent_size=args.latent, num_experts=args.experts,
                          topk=args.topk, expert_ffn_size=args.expert_ffn,
                          num_shared_experts=args.shared_experts, shared_ffn_size=args.shared_ffn,
                          dispatcher=FoldedDispatcher(args.experts, args.ep))
        x = torch.randn(tokens, args.hidden, requires_grad=True)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda", cache_enabled=False)
    router, k = layer.router, args.topk
    with torch.no_grad(), autocast:
        # One Quantile Balancing update first: the loads the trainer sees after its first step.
        router.bias.copy_(quantile_balance(router(x).scores, router.bias, k))
        routing = router(x)
        latent = layer.down(x)
        x_sorted, counts, _ = layer.dispatcher.dispatch(latent, routing.indices, routing.weights)
        routed = layer.dispatcher.combine(layer.experts(x_sorted, counts), _)
    latent, x_sorted, routed = (t.detach().requires_grad_() for t in (latent, x_sorted, routed))
    weights = routing.weights.detach().requires_grad_()
    scores = routing.scores.detach()

    def permute():
        xs, _counts, state = layer.dispatcher.dispatch(latent, routing.indices, weights)
        return layer.dispatcher.combine(xs, state)

    def whole_layer():
        layer.routing.clear()  # the trainer clears it every step; here it would grow every call
        return layer(x)

    trained = {  # forward+backward
        "layer": whole_layer,
        "router": lambda: router(x).weights,
        "permute": permute,
        "experts": lambda: layer.experts(x_sorted, counts),
        "latent": lambda: (layer.down(x), layer.up(layer.norm(routed))),
        "shared": lambda: layer.shared(x),
    }
    no_grad = {  # Quantile Balancing: its cutoff (top-(k+1) and margins) and the whole update
        "qb_cutoff": lambda: _margins(scores, router.bias, k),
        "qb_update": lambda: quantile_balance(scores, router.bias, k),
    }
    leaves = (x, latent, x_sorted, routed, weights)

    def fresh_grads(run):
        # Each part's backward writes its own gradients, fp32 expert weight gradients being
        # 15 GB at EP=8: drop the previous call's first so that only one set is alive.
        def call():
            layer.zero_grad(set_to_none=True)
            for t in leaves:
                t.grad = None
            run()
        return call

    # Backward from fixed random output gradients, made once per shape: a squared-mean loss
    # would add fp32 copies of each output ([16 x tokens, 3584] for the experts: 15 GB at 64K).
    out_grads: dict = {}

    def fwd_bwd(fn):
        def run():
            with autocast:
                outs = fn()
            outs = outs if isinstance(outs, tuple) else (outs,)
            for o in outs:
                if (o.shape, o.dtype) not in out_grads:
                    out_grads[o.shape, o.dtype] = torch.randn_like(o)
            grads = [out_grads[o.shape, o.dtype] for o in outs]
            torch.autograd.backward(outs, grads)
        return run

    calls = {name: fresh_grads(fwd_bwd(fn)) for name, fn in trained.items()}
    calls.update(no_grad)
    timer = dict(warmup=2, iters=args.iters if dev.type == "cuda" else 1, device=dev.type)
    times = {}
    for name, fn in calls.items():
        try:
            times[name] = timeit(fn, **timer)
        except torch.OutOfMemoryError:
            # 64K tokens keep ~100 GB alive through the backward; report the part, not a crash.
            times[name] = float("nan")
            print(f"{name}: out of device memory at {tokens} tokens", flush=True)
            torch.cuda.empty_cache()
    # Replayed from a CUDA graph: the router's parts are many small kernels whose eager time also
    # counts the host's launch cost; the big GEMM parts are not captured (memory, no gain).
    graphed = ({name: graph_ms(calls[name]) for name in ("router", "qb_cutoff", "qb_update")}
               if dev.type == "cuda" else {})
    best = {name: min(times[name], graphed.get(name, float("inf"))) for name in times}  # nan stays nan
    router_sum = best["router"] + best["qb_cutoff"]
    local = counts.float()
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "tokens": tokens, "ep": args.ep, "local_experts": layer.dispatcher.num_local_experts,
              "rows": int(counts.sum()), "rows_per_expert_max_over_mean": float(local.max() / local.mean()),
              "shape": {n: getattr(args, n) for n in (*K3, "ep")},
              "ms": times, "graph_ms": graphed, "share_of_layer": {n: v / times["layer"] for n, v in times.items()},
              "router_plus_cutoff_ms": router_sum,
              "router_plus_cutoff_over_experts": router_sum / times["experts"],
              "router_plus_update_over_experts": (best["router"] + best["qb_update"]) / times["experts"]}
    print(f"K3 LatentMoE fwd+bwd, one of EP={args.ep} ranks: {tokens} tokens, d={args.hidden} "
          f"latent={args.latent} E={args.experts} top-{k} ({result['local_experts']} local, "
          f"{result['rows']} rows, max/mean {result['rows_per_expert_max_over_mean']:.2f}) "
          f"ffn={args.expert_ffn} shared={args.shared_experts}x{args.shared_ffn} ({result['device']})")
    print(f"{'part':<11}{'ms':>10}{'of layer':>10}{'graph ms':>10}")
    for name, ms in times.items():
        g = f"{graphed[name]:>10.3f}" if name in graphed else ""
        print(f"{name:<11}{ms:>10.3f}{ms / times['layer']:>10.1%}{g}")
    print(f"router + QB cutoff = {router_sum:.3f} ms = {result['router_plus_cutoff_over_experts']:.1%} "
          f"of the grouped experts (target <= 10%); with the whole QB update "
          f"{result['router_plus_update_over_experts']:.1%}", flush=True)
    if args.profile:
        print(profile_table(calls["layer"], device=dev.type), flush=True)
    del layer, x, latent, x_sorted, routed, calls, trained, leaves, out_grads
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return result


def print_k3_summary(rows: list[dict]) -> None:
    print(f"{'tokens':>7}{'layer ms':>10}{'experts ms':>11}{'router+cutoff ms':>17}{'ratio':>7}"
          f"{'with QB update':>15}")
    for r in rows:
        print(f"{r['tokens']:>7}{r['ms']['layer']:>10.2f}{r['ms']['experts']:>11.2f}"
              f"{r['router_plus_cutoff_ms']:>17.3f}{r['router_plus_cutoff_over_experts']:>7.1%}"
              f"{r['router_plus_update_over_experts']:>15.1%}")


if __name__ == "__main__":
    main()
