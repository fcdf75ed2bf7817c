"""Write one fixed Triton config per fla kernel so that fla skips autotuning (fast start).

    python3 scripts/fla_fast_configs.py OUTDIR
    export FLA_CONFIG_DIR=OUTDIR FLA_CACHE_MODE=default

Why: fla autotunes each kernel over up to ~36 configurations on first use, compiling every one.
Where a Triton compile takes seconds (about 8 s each on the GPU machines we borrow), the first
KDA forward+backward costs many minutes. fla's ``fla_cache_autotune`` kernels read
``$FLA_CONFIG_DIR/<kernel>.json`` when ``FLA_CACHE_MODE`` is set; with ``default`` they take its
``default_config`` and compile once. This script writes, for every such kernel that k3train's
paths use (KDA chunk forward/backward and its gate, l2norm, short conv, AttnRes, cumsum), the
configuration with the smallest tiles, fewest stages and fewest warps, which fits every shape's
shared memory. Use it for correctness runs: speed benchmarks should let fla autotune.
Kernels fla decorates with plain ``triton.autotune`` (e.g. ``solve_tril``) still autotune.
"""
from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

MODULES = ["fla.ops.kda", "fla.ops.kda.gate", "fla.ops.kda.chunk_bwd", "fla.ops.kda.chunk_intra",
           "fla.ops.kda.chunk_intra_token_parallel", "fla.ops.kda.wy_fast", "fla.ops.common.chunk_delta_h",
           "fla.ops.common.chunk_o", "fla.ops.gla.chunk", "fla.ops.utils.cumsum", "fla.modules.norm.l2norm",
           "fla.modules.causal_conv1d.ops", "fla.ops.attnres.fused"]


def _autotuner(obj, cls):
    """The autotuner inside ``obj`` (through ``triton.heuristics`` wrappers), or None."""
    for _ in range(4):
        if isinstance(obj, cls):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def smallest(configs):
    """The config with the least on-chip resources: tile sizes, then stages, then warps."""
    def cost(c):
        tiles = math.prod(v for v in c.kwargs.values() if isinstance(v, int) and v > 0)
        return (tiles, c.num_stages, c.num_warps)
    return min(configs, key=cost)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    from fla.ops.utils.cache import CachedAutotuner

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in MODULES:
        for obj in vars(importlib.import_module(name)).values():
            tuner = _autotuner(obj, CachedAutotuner)
            if tuner is None or tuner.kernel_name in written:
                continue
            cfg = smallest(tuner.configs)
            entry = {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                     "num_ctas": getattr(cfg, "num_ctas", 1)}
            (out / f"{tuner.kernel_name}.json").write_text(
                json.dumps({"kernel_name": tuner.kernel_name, "default_config": entry}, indent=1))
            written[tuner.kernel_name] = len(tuner.configs)
    for kernel, n in sorted(written.items()):
        print(f"{kernel}: 1 config instead of {n}")
    print(f"wrote {len(written)} kernel configs to {out} "
          f"({sum(written.values())} autotune candidates skipped); "
          f"export FLA_CONFIG_DIR={out} FLA_CACHE_MODE=default")
    return 0


if __name__ == "__main__":
    sys.exit(main())
