"""GPU path against the CPU reference: same weights, same batch.

Checks (prints JSON; exit 1 on failure):
* KDA layer: CUDA (fla chunk_kda when installed, bf16 autocast) vs CPU fp32 pure-torch chunked form;
* the whole k3_tiny model: loss and every parameter gradient, CUDA bf16 autocast vs CPU fp32.
Tolerances are bf16-level: relative L2 error of outputs < 2e-2, gradient cosine > 0.99.

    python scripts/gpu_check.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch

warnings.filterwarnings("ignore")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu().flatten(), b.float().cpu().flatten()
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu only dry-runs the script itself")
    args = ap.parse_args()
    dev = args.device
    from k3train.config import load_config
    from k3train.distributed import init_distributed
    from k3train.model.kda_layer import KimiDeltaAttention
    from k3train.model.model import build_model
    from k3train.ops.kda import kda_backend

    init_distributed(device=dev)
    out = {"kda_backend": kda_backend(dev)}
    torch.manual_seed(0)
    layer = KimiDeltaAttention(256, 4, 64)
    torch.manual_seed(0)
    gpu_layer = KimiDeltaAttention(256, 4, 64).to(dev)  # same seed: same weights
    x = torch.randn(2, 512, 256)
    ref = layer(x)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev == "cuda"):
        got = gpu_layer(x.to(dev))
    out["kda_layer_rel_err"] = rel_err(got, ref)

    # AttnRes depth mixing: the dispatched kernel vs the torch reference, value and gradients,
    # on mixed-dtype sources as autocast produces them (fp32 blocks, a bf16 partial sum).
    from k3train.ops.attnres import attnres_backend, depth_mix, depth_mix_torch

    out["attnres_backend"] = attnres_backend(dev)
    q0 = torch.randn(256)
    src0 = [torch.randn(2, 512, 256) * (i + 1) for i in range(4)]
    leaves = [[t.clone().requires_grad_() for t in [q0, *src0]] for _ in range(2)]
    mixed = [leaves[1][0].to(dev)] + [t.to(dev) for t in leaves[1][1:4]] + [leaves[1][4].to(dev, torch.bfloat16)]
    ref_mix = depth_mix_torch(leaves[0][0], [*leaves[0][1:4], leaves[0][4].bfloat16().float()], 1e-6)
    got_mix = depth_mix(mixed[0], mixed[1:], 1e-6)
    w = torch.randn_like(ref_mix)
    (ref_mix * w).sum().backward()
    (got_mix.float() * w.to(dev)).sum().backward()
    out["attnres_rel_err"] = rel_err(got_mix, ref_mix)
    out["attnres_worst_grad_cosine"] = min(cosine(a.grad, b.grad) for a, b in zip(leaves[1], leaves[0]))

    cfg = load_config("configs/k3_tiny.yaml")
    model = build_model(cfg)
    tokens = torch.randint(0, 257, (4, 257))
    loss_cpu = model(tokens[:, :-1], tokens[:, 1:])
    loss_cpu.backward()
    gpu_model = build_model(cfg).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev == "cuda"):
        loss_gpu = gpu_model(tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
    loss_gpu.backward()
    out["model_loss_cpu"], out["model_loss_gpu"] = loss_cpu.item(), loss_gpu.item()
    cpu_grads = dict(model.named_parameters())
    worst = min(((cosine(p.grad, cpu_grads[n].grad), n) for n, p in gpu_model.named_parameters()
                 if p.grad is not None and cpu_grads[n].grad.norm() > 0))
    out["worst_grad_cosine"], out["worst_grad_param"] = worst
    ok = (out["kda_layer_rel_err"] < 2e-2 and out["attnres_rel_err"] < 1e-4
          and out["attnres_worst_grad_cosine"] > 0.9999 and abs(out["model_loss_gpu"] - out["model_loss_cpu"]) < 2e-2
          and out["worst_grad_cosine"] > 0.99)
    out["ok"] = ok
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
