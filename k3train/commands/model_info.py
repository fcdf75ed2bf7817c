"""Parameters per component (total and activated per token, counted on the meta device, so the
full K3 costs no memory), then each pipeline rank's memory for the parallel.* layout with --dp
data-parallel replicas (and --cp context-parallel ranks: predicted). Given an ablation file, each variant's differences from its base come
first and the counts are for the base. With --fit GIB, instead of the one layout's memory: the
layouts (tp, pp, vpp, ep, dp, cp, micro-batch, ZeRO-1, weight and moment dtypes, recompute) of
--nodes or --world GPUs whose heaviest rank fits GIB, for pretraining and SFT, with their
predicted MFU. See docs/memory.md."""
from __future__ import annotations

from k3train.commands.common import add_config_args
from k3train.errors import UsageError

HELP = "print parameters per component and the per-rank memory of the layout"


def add_arguments(p) -> None:
    add_config_args(p)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas per pipeline stage for the "
                   "memory plan (a multiple of parallel.ep; docs/memory.md)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks for the memory plan (default: "
                   "parallel.cp): each keeps seq_len/cp tokens' activations plus the CP exchanges (predicted)")
    fit = p.add_argument_group("layout search (--fit)")
    fit.add_argument("--fit", type=float, default=None, metavar="GIB",
                     help="search the layouts whose heaviest rank fits GIB of GPU memory (141 for H200, 80 "
                          "for H100) and print them best first with their predicted MFU (docs/memory.md)")
    fit.add_argument("--nodes", default="32,64,128", help="comma-separated node counts to search (default "
                     "32,64,128); ignored with --world")
    fit.add_argument("--world", type=int, default=None, help="one world size in GPUs to search instead of --nodes")
    fit.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    fit.add_argument("--task", choices=["pretrain", "sft", "both"], default="both",
                     help="pretraining at 4096 tokens, SFT at 32768, or both (default)")
    fit.add_argument("--margin", type=float, default=0.10, help="fraction of GIB kept free for what the "
                     "planner does not count (CUDA context, NCCL buffers, fragmentation; default 0.10)")
    fit.add_argument("--batch-tokens", type=int, default=1 << 24, help="tokens per optimizer update, which "
                     "sets the microbatches per update (default 16,777,216)")
    fit.add_argument("--top", type=int, default=8, help="layouts shown per task and world size (default 8)")


def run(args) -> int:
    from k3train.commands.config import load_config_or_ablation
    from k3train.model.info import format_info, model_info
    from k3train.profiling.memory_plan import memory_report
    from k3train.runtime.one_process import process_groups

    cfg, variants = load_config_or_ablation(args.config, args.overrides)
    if variants:
        print(variants)
    if args.fit is not None:
        return _run_fit(cfg, args)
    with process_groups():
        counts, assumptions = model_info(cfg)
        memory = memory_report(cfg, args.dp, args.cp)   # builds on the meta device too: needs the groups
    print(f"model: {args.config}  ({cfg.model.num_layers} layers, pattern {cfg.model.layer_pattern}, "
          f"hidden {cfg.model.hidden_size}, {cfg.moe.num_experts} experts top-{cfg.moe.topk})")
    print(format_info(counts, assumptions))
    print(memory)
    return 0


def _run_fit(cfg, args) -> int:
    from k3train.profiling.layout_fit import fit_layouts, format_fits
    from k3train.runtime.one_process import process_groups

    g = args.gpus_per_node
    try:
        worlds = [args.world] if args.world else [int(n) * g for n in args.nodes.split(",")]
    except ValueError:
        raise UsageError(f"--nodes takes comma-separated node counts, e.g. 32,64,128; got {args.nodes!r}") from None
    if g < 1 or any(w < 1 for w in worlds) or args.top < 1 or args.batch_tokens < 1:
        raise UsageError(f"--gpus-per-node, --nodes/--world, --top and --batch-tokens must be positive; got "
                         f"{g}, {worlds}, {args.top}, {args.batch_tokens}")
    tasks = ["pretrain", "sft"] if args.task == "both" else [args.task]
    with process_groups():   # the meta-device model build needs the (size-1) groups
        fits = fit_layouts(cfg, worlds=worlds, fit_gib=args.fit, margin=args.margin, tasks=tasks,
                           batch_tokens=args.batch_tokens)
        print(format_fits(cfg, fits, fit_gib=args.fit, margin=args.margin, top=args.top, gpus_per_node=g,
                          batch_tokens=args.batch_tokens))
    return 0
