"""KDA layer forward+backward on one GPU against its floor and against fla's own layer.

Floor = fla's ``chunk_kda`` kernel alone (fwd+bwd, same shape, called as both layers call it:
in-kernel q/k l2norm, K3 safe gate and beta sigmoid) + the layer's projection GEMMs (q, k, v,
output gate, output, low-rank forget gate) at the bf16 matmul rate measured in the same run.
Both layers run with bf16 weights (no autocast), the K3 safe gate (lower bound -5) on both.

Each figure twice: timed eagerly, and replayed from a CUDA graph (``graph_*``: device time
alone, as ``train.cuda_graph`` runs the step; eagerly the host's launch cost of fla's Python
wrappers is counted too, and at this shape it exceeds the kernels' device time). Plus an
ablation of our layer with one fused q/k/v GEMM and conv (``graph_ours_fused_qkv_ms``), and
the short convolution side by side: ours (``k3train/ops/short_conv_triton.py``) against fla's
``causal_conv1d``, alone on one ``[B, T, H*K]`` input (``graph_conv_*_ms``) and inside our layer
(``graph_ours_fla_conv_ms``: the layer with fla's conv).

    python3 -m benchmarks.bench_kda_layer [--batch 4 --seq 4096 --hidden 2048 --heads 16 --head-dim 128]
"""
from __future__ import annotations

import argparse
import json
import warnings

import torch

from benchmarks.common import graph_ms, matmul_tflops, profile_table, save_json, timeit  # noqa: E402

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="print the top operators of our layer")
    ap.add_argument("--json")
    args = ap.parse_args()
    from fla.ops.kda import chunk_kda

    from k3train.runtime.distributed import init_distributed
    from k3train.model.kda_layer import KimiDeltaAttention
    from k3train.ops.triton_compile import compile_ahead

    init_distributed(device="cuda")
    B, T, D, H, K = args.batch, args.seq, args.hidden, args.heads, args.head_dim
    dev, bf16 = "cuda", torch.bfloat16
    peak = matmul_tflops()

    q, k = (torch.randn(B, T, H, K, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, K, device=dev, dtype=bf16, requires_grad=True)
    f = torch.randn(B, T, H, K, device=dev, dtype=bf16, requires_grad=True)
    beta = torch.randn(B, T, H, device=dev, dtype=bf16, requires_grad=True)
    A_log = torch.zeros(H, device=dev, requires_grad=True)
    dt_bias = torch.zeros(H * K, device=dev, requires_grad=True)
    do = torch.randn(B, T, H, K, device=dev, dtype=bf16)

    def kernel():
        # The call both layers make: l2norm, safe gate and beta sigmoid fused into the kernel.
        o, _ = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=-5.0)
        o.backward(do)

    # Projections: q, k, v, output gate and output (d x H*K each) plus the low-rank gate (d x K,
    # K x H*K); forward and the two backward GEMMs each.
    proj_flops = (5 * D * H * K + D * K + K * H * K) * 2 * B * T * 3

    x = torch.randn(B, T, D, device=dev, dtype=bf16, requires_grad=True)
    dy = torch.randn(B, T, D, device=dev, dtype=bf16)
    ours = KimiDeltaAttention(hidden_size=D, num_heads=H, head_dim=K).to(dev, bf16)

    def run_ours():
        ours(x).backward(dy)

    from k3train.ops import kernels
    from k3train.ops import short_conv as sc

    def run_ours_fla_conv():
        # The same layer with fla's causal_conv1d for its three convolutions.
        with kernels.using(short_conv="fla"):
            run_ours()

    xc = torch.randn(B, T, H * K, device=dev, dtype=bf16, requires_grad=True)
    wc = torch.randn(H * K, 4, device=dev, dtype=bf16, requires_grad=True)
    dyc = torch.randn_like(xc)

    def conv_with(backend):
        def run():
            with kernels.using(short_conv=backend):
                sc.short_conv_silu(xc, wc).backward(dyc)
        return run

    def run_fused():
        # Ablation: the q/k/v projections as one GEMM over concatenated weights and one conv over
        # the 3HK channels, q/k/v then strided views (the layer runs three of each, as fla does).
        from k3train.ops.gated_norm import head_norm_gate
        from k3train.ops.kda import kda_gated
        from k3train.ops.short_conv import short_conv_silu

        shape, lay = (B, T, H, K), ours
        w = torch.cat([lay.q_proj.weight, lay.k_proj.weight, lay.v_proj.weight])
        qkv = short_conv_silu(torch.nn.functional.linear(x, w), torch.cat([lay.q_conv, lay.k_conv, lay.v_conv]))
        q, k, v = (t.view(shape) for t in qkv.split(H * K, dim=-1))
        f = lay.f_up(lay.f_down(x)).view(shape)
        o = kda_gated(q, k, v, f, lay.b_proj(x), lay.A_log, lay.dt_bias, lay.lower_bound)
        o = head_norm_gate(o, lay.o_norm_weight, lay.g_proj(x).view(shape), lay.eps)
        lay.o_proj(o.reshape(B, T, -1)).backward(dy)

    peer, result = None, {}
    try:
        from fla.layers import KimiDeltaAttention as FlaKDA

        peer = FlaKDA(hidden_size=D, num_heads=H, head_dim=K, mode="chunk", safe_gate=True,
                      lower_bound=-5.0).to(dev, bf16)
    except Exception as exc:  # noqa: BLE001 - report a peer that cannot be built, keep our figures
        result["fla_layer_error"] = repr(exc)

    def run_peer():
        peer(x)[0].backward(dy)

    # Every kernel and autotune candidate of the three, compiled in parallel before timing.
    runs = ([kernel, run_ours, run_fused, run_ours_fla_conv, conv_with("k3train"), conv_with("fla")]
            + ([run_peer] if peer is not None else []))
    result["compile_ahead"] = compile_ahead(lambda: [run() for run in runs], label="bench_kda_layer")
    kernel_ms = timeit(kernel, warmup=3, iters=10)
    floor_ms = kernel_ms + proj_flops / (peak * 1e12) * 1e3
    ours_ms = timeit(run_ours, warmup=3, iters=10)
    if args.profile:
        print(profile_table(run_ours), flush=True)
    result.update({"shape": f"B{B} T{T} D{D} H{H} K{K}", "bf16_matmul_tflops": peak, "kernel_ms": kernel_ms,
                   "floor_ms": floor_ms, "ours_ms": ours_ms, "ours_over_floor": ours_ms / floor_ms})
    if peer is not None:
        result["fla_layer_ms"] = timeit(run_peer, warmup=3, iters=10)
        result["fla_over_floor"] = result["fla_layer_ms"] / floor_ms
        result["ours_vs_fla"] = ours_ms / result["fla_layer_ms"]
    # The same three replayed from CUDA graphs: device time alone, without the host's launch cost
    # (fla's chunk_kda spends ~2 ms of Python per call, which eager timing also counts).
    kernel_g = graph_ms(kernel)
    floor_g = kernel_g + proj_flops / (peak * 1e12) * 1e3
    result.update({"graph_kernel_ms": kernel_g, "graph_floor_ms": floor_g, "graph_ours_ms": graph_ms(run_ours),
                   "graph_ours_fused_qkv_ms": graph_ms(run_fused),
                   "graph_ours_fla_conv_ms": graph_ms(run_ours_fla_conv),
                   "graph_conv_ours_ms": graph_ms(conv_with("k3train")),
                   "graph_conv_fla_ms": graph_ms(conv_with("fla"))})
    result["conv_fla_over_ours"] = result["graph_conv_fla_ms"] / result["graph_conv_ours_ms"]
    result["graph_ours_over_floor"] = result["graph_ours_ms"] / floor_g
    if peer is not None:
        result["graph_fla_layer_ms"] = graph_ms(run_peer)
        result["graph_fla_over_floor"] = result["graph_fla_layer_ms"] / floor_g
    print(json.dumps(result, indent=1))
    save_json(args.json, result)


if __name__ == "__main__":
    main()
