"""One process: per-layer times measured (chunks of --layers-per-chunk layers) or read from
--costs, then the pipeline timing model's step time, bubble and AttnRes overhead for P in
2,4,8,16, V in 1,2,4, m in 8,16,32, and K3's shapes scaled by FLOPs (predicted).
See docs/pipeline_timing_model.md."""
from __future__ import annotations

from k3train.commands.common import add_config_args

HELP = ("measure per-layer times and print the pipeline timing model's predictions "
        "(step time, bubble, AttnRes overhead) for P, V, m and K3's shapes")


def add_arguments(p) -> None:
    add_config_args(p)
    p.add_argument("--json", required=True, help="report path")
    p.add_argument("--steps", type=int, default=3, help="timed steps per measured chunk")
    p.add_argument("--costs", help="per-layer times from this json (a report's layer_costs) instead of measuring")
    p.add_argument("--k3-config", default="configs/k3_full.yaml",
                   help="the K3 shapes scaled by FLOPs ('' to skip)")
    p.add_argument("--link-latency-us", type=float, help="p2p latency (default 32, 2x H200)")
    p.add_argument("--link-gbps", type=float, help="p2p bandwidth GB/s (default 315, 2x H200)")
    p.add_argument("--layers-per-chunk", type=int, default=1,
                   help="time chunks of this many layers and split each by FLOPs (default 1)")


def run(args) -> int:
    from k3train.config import load_config
    from k3train.profiling.predict import H200_LINK, run_predict
    from k3train.runtime.cuda_env import prepare_cuda_env
    from pipeline.timing_model import LinkCost

    cfg = load_config(args.config, args.overrides)
    prepare_cuda_env(cfg)
    link = LinkCost(latency_s=(args.link_latency_us * 1e-6 if args.link_latency_us is not None
                               else H200_LINK.latency_s),
                    bandwidth_Bps=args.link_gbps * 1e9 if args.link_gbps else H200_LINK.bandwidth_Bps)
    run_predict(cfg, args.json, costs_path=args.costs, k3_config=args.k3_config or None, link=link,
                steps=args.steps, layers_per_chunk=args.layers_per_chunk)
    return 0
