"""Muon at ``parallel.tp=2`` against ``tp=1`` on two GPUs (NCCL, bf16 Newton-Schulz).

Run under torchrun with two ranks. Each rank builds the small model (configs/k3_tiny.yaml with
tests' SMALL sizes, fp32 weights on CUDA) at TP=2, gives every parameter its slice of fixed
whole gradients, takes two Muon steps (``build_k3_optimizer``, as the trainer builds it) and
gathers the weights whole; then the same at TP=1 (each rank alone), and, for contrast, at TP=2
with each shard orthogonalised on its own (the optimizer given no TP group: the behaviour before
the fix). For each Muon matrix that TP splits across its Newton-Schulz blocks it prints the
relative Frobenius error of the TP=2 update against the TP=1 one, ``|dW_tp2 - dW_tp1| / |dW_tp1|``.

PASS: for each optimizer form (replicated Muon, ZeRO-1), the largest error with the fix is
below ``--tol`` (default 0.03: bf16 Newton-Schulz, the same inputs, other batches) and the
shard-local contrast's is at least 10x larger (the check can tell them apart). Exit 1
otherwise. Writes ``$OUT/muon_tp.json`` when ``OUT`` is set.

    torchrun --nproc_per_node 2 scripts/gpu_check_muon_tp.py [--tol 0.03] [--device cpu]

``--device cpu`` runs the same on gloo in fp32 (a dry run of the script: errors ~1e-6).

Expected runtime on two H200s: well under a minute (mostly imports and Triton autotuning).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
warnings.filterwarnings("ignore")

from megatron.core import parallel_state as ps  # noqa: E402

from k3train.config import load_config  # noqa: E402
from k3train.model.model import build_model  # noqa: E402
from k3train.runtime.distributed import init_distributed  # noqa: E402
from k3train.trainer.optimizer import build_k3_optimizer, k3_param_rules  # noqa: E402
from optim import GradGroups, build_param_table  # noqa: E402
from optim.muon import tp_split_dim  # noqa: E402

SMALL = ["model.hidden_size=64", "model.num_layers=4", "model.kda.num_heads=2", "model.kda.head_dim=32",
         "model.mla.num_heads=2", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
         "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16",
         "model.ffn.intermediate_size=128", "moe.num_experts=4", "moe.latent_size=32",
         "moe.expert_ffn_size=32", "moe.shared_ffn_size=64", "optim.name=muon"]


def _whole(p: torch.Tensor, tp: int) -> torch.Tensor:
    t = p.detach()
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=p.partition_dim)


def _deltas(tp: int, flags: list[str], with_tp_group: bool, device: str) -> tuple[dict, list[str]]:
    """{name: whole weight after - before} for two steps at ``tp``; the gathered Muon names."""
    init_distributed(tp=tp, device=device)
    cfg = load_config("configs/k3_tiny.yaml", [*SMALL, f"train.device={device}", *flags])
    torch.manual_seed(3)
    model = build_model(cfg).to(device)
    before = {n: _whole(p, tp) for n, p in model.named_parameters()}
    groups = GradGroups(tp=ps.get_tensor_model_parallel_group() if with_tp_group else None)
    experts = [p for layer in model.moe_layers() for p in layer.experts.parameters()]
    opt, _ = build_k3_optimizer(model, cfg.optim, groups=groups, expert_params=experts)
    for step in range(2):
        for i, (_n, p) in enumerate(model.named_parameters()):
            shape = list(p.shape)
            split = tp > 1 and getattr(p, "tensor_model_parallel", False)
            if split:
                shape[p.partition_dim] *= tp
            g = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + i))
            if split:
                g = g.chunk(tp, dim=p.partition_dim)[ps.get_tensor_model_parallel_rank()]
            p.grad = g.contiguous().to(device)
        opt.step()
        opt.zero_grad()
    table = build_param_table(model.named_parameters(), k3_param_rules(model, cfg.optim.muon_per_head))
    gathered = [e.name for e in table if e.optimizer == "muon" and tp_split_dim(e.param, e.heads) is not None]
    return {n: _whole(p, tp) - before[n] for n, p in model.named_parameters()}, gathered


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tol", type=float, default=0.03)
    ap.add_argument("--device", default="cuda", help="cuda (NCCL; the check) or cpu (gloo, fp32: a dry run)")
    args = ap.parse_args()
    results, ok = {}, True
    for form, flags in (("replicated", ["optim.muon_distributed=false"]), ("zero1", ["optim.zero1=true"])):
        fixed, gathered = _deltas(2, flags, True, args.device)
        local, _ = _deltas(2, flags, False, args.device)
        ref, _ = _deltas(1, flags, True, args.device)

        def err(d):
            return {n: ((d[n] - ref[n]).norm() / ref[n].norm()).item() for n in gathered}

        e_fixed, e_local = err(fixed), err(local)
        worst_fixed, worst_local = max(e_fixed.values()), max(e_local.values())
        passed = worst_fixed < args.tol and worst_local >= 10 * worst_fixed
        ok &= passed
        results[form] = {"gathered": len(gathered), "max_rel_err_fixed": worst_fixed,
                         "max_rel_err_shard_local": worst_local, "pass": passed, "per_matrix": e_fixed}
        if dist.get_rank() == 0:
            print(f"{form}: {len(gathered)} gathered matrices; max rel err {worst_fixed:.2e} "
                  f"(shard-local, before the fix: {worst_local:.2e}) -> {'PASS' if passed else 'FAIL'}",
                  flush=True)
    if dist.get_rank() == 0:
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "muon_tp.json"), "w") as f:
                json.dump(results, f, indent=1)
        print("PASS" if ok else "FAIL", flush=True)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
