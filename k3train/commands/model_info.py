"""Parameters per component (total and activated per token, counted on the meta device, so the
full K3 costs no memory), then each pipeline rank's memory for the parallel.* layout with --dp
data-parallel replicas (and --cp context-parallel ranks: predicted). Given an ablation file, each variant's differences from its base come
first and the counts are for the base. See docs/memory.md."""
from __future__ import annotations

from k3train.commands.common import add_config_args

HELP = "print parameters per component and the per-rank memory of the layout"


def add_arguments(p) -> None:
    add_config_args(p)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas per pipeline stage for the "
                   "memory plan (a multiple of parallel.ep; docs/memory.md)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks for the memory plan (default: "
                   "parallel.cp): each keeps seq_len/cp tokens' activations plus the CP exchanges (predicted)")


def run(args) -> int:
    from k3train.commands.config import load_config_or_ablation
    from k3train.model.info import format_info, model_info
    from k3train.profiling.memory_plan import memory_report
    from k3train.runtime.one_process import process_groups

    cfg, variants = load_config_or_ablation(args.config, args.overrides)
    if variants:
        print(variants)
    with process_groups():
        counts, assumptions = model_info(cfg)
        memory = memory_report(cfg, args.dp, args.cp)   # builds on the meta device too: needs the groups
    print(f"model: {args.config}  ({cfg.model.num_layers} layers, pattern {cfg.model.layer_pattern}, "
          f"hidden {cfg.model.hidden_size}, {cfg.moe.num_experts} experts top-{cfg.moe.topk})")
    print(format_info(counts, assumptions))
    print(memory)
    return 0
