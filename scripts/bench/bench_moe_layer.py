"""Where a LatentMoE layer's time goes on one device: router, permutation, experts, the rest.

    python scripts/bench/bench_moe_layer.py [--json OUT]          # one GPU, k3_mini's MoE shape
    python scripts/bench/bench_moe_layer.py --device cpu --small  # CPU dry run

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
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import graph_ms, profile_table, save_json, timeit  # noqa: E402

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU dry run)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per layer call (k3_mini: 8 x 2048)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--shared-ffn", type=int, default=2048)
    ap.add_argument("--profile", action="store_true", help="print the top operators of the layer")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.small:
        args.tokens, args.hidden, args.latent, args.experts, args.expert_ffn, args.shared_ffn = 256, 64, 32, 8, 32, 64
        args.topk = min(args.topk, 2)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible; use --device cpu --small")
    from moe import LatentMoE

    dev = torch.device(args.device)
    torch.manual_seed(0)
    layer = LatentMoE(hidden_size=args.hidden, latent_size=args.latent, num_experts=args.experts,
                      topk=args.topk, expert_ffn_size=args.expert_ffn, num_shared_experts=1, shared_ffn_size=args.shared_ffn).to(dev)
    # No weight-cast cache: the CUDA-graph timings below record the casts, as train.cuda_graph does.
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda", cache_enabled=False)
    x = torch.randn(args.tokens, args.hidden, device=dev, requires_grad=True)

    def fwd_bwd(fn):
        """fn returns a tensor or a tuple of tensors; one backward through all of them."""
        def run():
            with autocast:
                outs = fn()
            outs = outs if isinstance(outs, tuple) else (outs,)
            sum(o.float().square().mean() for o in outs).backward()
        return run

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
              "shape": vars(args), "ms": times, "share_of_layer": {k: v / total for k, v in times.items()},
              "sum_of_parts_ms": summed, "grouped_over_loop": times["experts_loop"] / times["experts"],
              "graph_ms": graphed}
    if graphed:
        result["graph_sum_of_parts_ms"] = sum(v for k, v in graphed.items() if k not in not_parts)
    print(f"LatentMoE fwd+bwd, {args.tokens} tokens, d={args.hidden} latent={args.latent} "
          f"E={args.experts} top-{args.topk} ffn={args.expert_ffn} shared={args.shared_ffn} ({result['device']})")
    print(f"{'part':<14}{'ms':>10}{'of layer':>10}{'graph ms':>10}")
    for name, ms in times.items():
        g = f"{graphed[name]:>10.3f}" if name in graphed else ""
        print(f"{name:<14}{ms:>10.3f}{ms / total:>10.1%}{g}")
    print(f"{'sum of parts':<14}{summed:>10.3f}{summed / total:>10.1%}   (without experts_loop)")
    print(f"grouped experts {result['grouped_over_loop']:.2f}x faster than the per-expert loop")
    if args.profile:
        print(profile_table(fwd_bwd(parts["layer"]), device=dev.type), flush=True)
    save_json(args.json, result)


if __name__ == "__main__":
    main()
