"""Context parallelism on GPUs (NCCL), alone and under the interleaved pipeline, against the
single-GPU run of the same model and data.

    python scripts/gpu_check_cp_pipeline.py --out DIR [--steps 30] [--only cp2_fp32,pp2_vpp2_cp2]

Each variant is ``k3train train`` on ``configs/k3_tiny.yaml`` under ``torchrun`` on as many GPUs
as its layout needs (cp2: 2; pp2 x vpp2 x cp2, also with ep2: 4; ``*_head_tail``: under
``parallel.cp_partition=head_tail``), document-masked windows (the default); its
reference is the same command in one process on one GPU with the same global batch. The runner,
the twin-split floor and the tolerances are ``scripts/gpu_parallel_check.py``'s (read its
docstring): fp32 variants (TF32 off) within 2e-5 at step 1 and within max(2e-5, 10 x the twin
floor) at step 2; bf16 variants within 0.02 at step 1 and 0.15 on average; every run learns
(last loss < first - 0.5). Prints one JSON line per variant, exits 1 if any fails.
``--device cpu`` dry-runs the script itself on gloo.
"""
from __future__ import annotations

import sys

from gpu_parallel_check import main as check

MB = ["train.micro_batch_size=8", "train.microbatches=2"]
# variant -> (processes, parallel overrides, reference overrides); 16 sequences per step in both.
VARIANTS = {
    "cp2_fp32": (2, ["parallel.cp=2", *MB], MB),
    "cp2": (2, ["parallel.cp=2", *MB], MB),
    "pp2_vpp2_cp2_fp32": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2", *MB], MB),
    "pp2_vpp2_cp2": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2", *MB], MB),
    "pp2_vpp2_cp2_full_recompute": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2",
                                        "train.recompute=full", *MB], MB),
    # Pipeline, experts and CP in one run: each stage's expert group is its two CP ranks (dp = 1).
    "pp2_vpp2_cp2_ep2_fp32": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2", "parallel.ep=2", *MB], MB),
    "pp2_vpp2_cp2_ep2": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2", "parallel.ep=2", *MB], MB),
    # An MX recipe under CP (bf16 autocast around the fake-quantised expert GEMMs), against the
    # same recipe on one GPU.
    "cp2_mxfp4_qat": (2, ["parallel.cp=2", "precision.recipe=mxfp4_qat", *MB], ["precision.recipe=mxfp4_qat", *MB]),
    # parallel.cp_partition=head_tail: two pieces per rank (the fold over 2P pieces, the halos'
    # batched NCCL send/receive, MLA per piece)
    "cp2_head_tail_fp32": (2, ["parallel.cp=2", "parallel.cp_partition=head_tail", *MB], MB),
    "pp2_vpp2_cp2_head_tail": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.cp=2",
                                   "parallel.cp_partition=head_tail", *MB], MB),
}


if __name__ == "__main__":
    sys.exit(check(VARIANTS, run_limit=240))
