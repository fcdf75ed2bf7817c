"""Sample continuations of --prompt (--batch N of them, or several prompts) from a checkpoint of
any layout, with the inference cache (KDA state and short-conv tails, MLA's absorbed latent)
and the decode step replayed from a CUDA graph. See docs/checkpoints.md#generate."""
from __future__ import annotations

from k3train.commands.common import RUN_CONFIG_HELP, add_checkpoint_arg

HELP = ("sample a continuation of --prompt from a checkpoint (any layout), "
        "with the KDA-state / MLA-latent inference cache")


def add_arguments(p) -> None:
    add_checkpoint_arg(p)
    p.add_argument("--prompt", required=True, action="append",
                   help="text to continue; give it several times for a batch of different prompts")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences decoded together: one --prompt sampled N times (default: one per --prompt)")
    p.add_argument("--cuda-graph", default="auto", choices=["auto", "true", "false"],
                   help="replay the decode step from a CUDA graph (auto: on for CUDA; default auto)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample (default 100, at most 100,000)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (1: off; default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step (torch.compile) before its CUDA graph: fewer, fused kernels "
                        "(k3_mini on an H200: 1.8x at batch 1), at about 25 s of compiling per batch size")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="weights and activations while decoding (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--config", help=RUN_CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def run(args) -> int:
    from k3train.infer.generate import run_generate

    return run_generate(args)
