"""The ``k3train generate`` arguments (no torch import: the CLI builds its parser before any command runs)."""
from __future__ import annotations


def _run(args) -> int:
    from k3train.infer.generate import run_generate

    return run_generate(args)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample a continuation of --prompt from a checkpoint (any layout), "
                                        "with the KDA-state / MLA-latent inference cache")
    p.add_argument("--checkpoint", required=True,
                   help="a step_XXXXXXXX directory, or a run's checkpoints/ directory (uses 'latest')")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--config", help="run config (default: config.yaml of the checkpoint's run directory)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.set_defaults(fn=_run)
