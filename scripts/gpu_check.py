"""GPU path against the CPU reference: same weights, same batch.

Checks (prints JSON; exit 1 on failure):
* KDA layer: CUDA (fla chunk_kda when installed, bf16 autocast) vs CPU fp32 pure-torch chunked form;
* short convolution: our Triton kernels (bf16, autotuned tiles) vs the torch form in fp32 on
  the same inputs: output, input and weight gradients (rel err < 2e-2);
* Muon: two steps on CUDA (bf16 Newton-Schulz, fused momentum and update passes) vs on CPU
  (fp32) from the same weights and gradients, a 2-D matrix and an expert stack (rel err of the
  weight change < 2e-2);
* AttnRes depth mixing: the dispatched kernel vs the torch form (fp32 math: rel err < 1e-4);
* k3_tiny: loss, CUDA bf16 autocast vs CPU fp32; its dense twin: loss and every gradient;
* ``train.cuda_graph`` on k3_tiny (MoE, AttnRes, Muon, Quantile Balancing): after the capture,
  a replay against an eager forward/backward on the same weights and batch (loss within 1e-3,
  all gradients together rel err < 2e-2); and 6 graphed and 6 eager training steps both learn
  (loss drops by > 0.5); the same again under ``train.recompute=selective`` and ``full``.
Tolerances are bf16-level: relative L2 error of outputs < 2e-2, |loss difference| < 2e-2,
gradient cosine > 0.99 over all parameters together and for every matrix of >= 4096 elements
(small vectors are reported: see the comment in main).

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
    a, b = a.double().cpu().flatten(), b.double().cpu().flatten()  # fp32 sums drift past 1.0
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def conv_check() -> dict:
    """Our Triton short convolution on CUDA vs the torch form in fp32 (k3_mini's q/k/v width)."""
    from k3train.ops.short_conv import _triton_conv, short_conv_silu_torch

    conv = _triton_conv()
    if conv is None:
        return {"conv_error": "Triton is not importable"}
    gen = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(2, 1000, 1024, generator=gen), torch.randn(1024, 4, generator=gen) * 0.5, \
        torch.randn(2, 1000, 1024, generator=gen)
    xg, wg = x.cuda().bfloat16().requires_grad_(), w.cuda().requires_grad_()
    y = conv(xg, wg)
    y.backward(dy.cuda().bfloat16())
    xr, wr = x.cuda().bfloat16().float().requires_grad_(), w.cuda().requires_grad_()
    ref = short_conv_silu_torch(xr, wr)
    ref.backward(dy.cuda().bfloat16().float())
    return {"conv_rel_err": rel_err(y, ref), "conv_dx_rel_err": rel_err(xg.grad, xr.grad),
            "conv_dw_rel_err": rel_err(wg.grad, wr.grad)}


def muon_check() -> dict:
    """Two Muon steps on CUDA vs on CPU from the same weights and gradients."""
    from optim import Muon

    gen = torch.Generator().manual_seed(1)
    shapes = [(384, 1024), (8, 256, 512)]
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    after = {}
    for dev in ("cpu", "cuda"):
        ps = [torch.nn.Parameter(p.clone().to(dev)) for p in init]
        opt = Muon(ps, lr=0.02, weight_decay=0.1)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.to(dev)
            opt.step()
        after[dev] = [p.detach().cpu() for p in ps]
    return {"muon_rel_err": max(rel_err(g - p0, c - p0)
                                for g, c, p0 in zip(after["cuda"], after["cpu"], init))}


def topk_check() -> dict:
    """Our Triton row top-k on CUDA vs torch.topk on CUDA (k3_mini's router shape, bf16 scores
    and an fp32 bias as under autocast): equal values; indices equal wherever no tie decides."""
    from moe.topk import _triton_topk

    mod = _triton_topk()
    if mod is None:
        return {"topk_error": "Triton is not importable"}
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(16384, 64, generator=gen).cuda().bfloat16()
    bias = (torch.randn(64, generator=gen) * 0.01).cuda()
    values, indices = mod.row_topk_triton(scores, 5, bias)
    ref = torch.topk(scores + bias, 5, dim=-1)
    untied = (ref.values[:, :-1] != ref.values[:, 1:]).all(-1)
    return {"topk_values_equal": bool(torch.equal(values, ref.values)),
            "topk_indices_equal_untied": bool(torch.equal(indices[untied], ref.indices[untied])),
            "topk_untied_rows": int(untied.sum())}


def graph_check(tokens: torch.Tensor, steps: int = 6, recompute: str = "none") -> dict:
    """``train.cuda_graph`` against eager on k3_tiny (MoE, AttnRes, Muon, Quantile Balancing),
    under ``train.recompute`` (keys ``graph_*``, or ``graph_<recompute>_*`` for selective/full:
    the recomputed forward runs inside the captured backward).

    Sharp part: after the capture, one replay and one eager forward/backward on the same weights
    and batch: the loss and every gradient must agree to bf16 atomics noise. Training part:
    ``steps`` graphed and eager steps both learn (bf16 runs drift apart step by step, so their
    losses are reported, not compared)."""
    from k3train.config import load_config
    from k3train.runtime.distributed import init_distributed
    from k3train.trainer.state import TrainState

    out, losses = {}, {}
    batches = [tokens.roll(i, dims=1) for i in range(steps)]
    for graph in (False, True):
        cfg = load_config("configs/k3_tiny.yaml", ["train.device=cuda", f"train.cuda_graph={graph}", "data.document_mask=false",
                                                  "train.micro_batch_size=2", "train.microbatches=2",
                                                  f"train.recompute={recompute}"])
        torch.manual_seed(0)
        state = TrainState(cfg, init_distributed(device="cuda"), torch.device("cuda"))
        losses[graph] = [state.train_step(b)["loss"] for b in batches]
    out["graph_captured"] = state.graphed.captured
    # The same weights, one batch: replay vs eager (no optimizer step in between).
    probe = tokens.roll(-1, dims=1)
    replay_loss = state.graphed(probe).item()
    replay = [p.grad.clone() for p in state.params]
    state.optimizer.zero_grad(set_to_none=True)
    for layer in state.moe_layers:
        layer.routing.clear()
    eager_loss = state._forward_backward(probe).item()
    eager = [p.grad for p in state.params]
    out["graph_replay_loss_diff"] = abs(replay_loss - eager_loss)
    out["graph_replay_grad_rel_err"] = rel_err(torch.cat([g.flatten() for g in replay]),
                                               torch.cat([g.flatten() for g in eager]))
    out["graph_losses_eager"], out["graph_losses_graphed"] = losses[False], losses[True]
    out["graph_ok"] = (out["graph_captured"] and out["graph_replay_loss_diff"] < 1e-3
                       and out["graph_replay_grad_rel_err"] < 2e-2
                       and all(v[-1] < v[0] - 0.5 for v in losses.values()))
    if recompute != "none":
        out = {k.replace("graph_", f"graph_{recompute}_", 1): v for k, v in out.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu only dry-runs the script itself")
    args = ap.parse_args()
    dev = args.device
    from k3train.config import load_config
    from k3train.runtime.distributed import init_distributed
    from k3train.model.kda_layer import KimiDeltaAttention
    from k3train.model.model import build_model
    from k3train.ops.attnres import attnres_backend, depth_mix, depth_mix_torch
    from k3train.ops.kda import kda_backend
    from k3train.ops.triton_compile import compile_ahead

    init_distributed(device=dev)
    out = {"kda_backend": kda_backend(dev)}
    x = torch.randn(2, 512, 256)
    q0 = torch.randn(256)
    src0 = [torch.randn(2, 512, 256) * (i + 1) for i in range(4)]
    w = torch.randn(2, 512, 256)
    tokens = torch.randint(0, 257, (4, 257))
    cfgs = {name: load_config("configs/k3_tiny.yaml", ov)
            for name, ov in (("model", []), ("dense", ["model.dense_layers=8"]))}

    def gpu_side():
        """Everything this check runs on the GPU, from freshly built (seeded) modules."""
        torch.manual_seed(0)
        layer = KimiDeltaAttention(hidden_size=256, num_heads=4, head_dim=64).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev == "cuda"):
            got = layer(x.to(dev))
        leaves = [t.clone().to(dev).requires_grad_() for t in [q0, *src0[:3]]]
        leaves.append(src0[3].to(dev, torch.bfloat16).requires_grad_())
        mix = depth_mix(leaves[0], leaves[1:], 1e-6)
        (mix.float() * w.to(dev)).sum().backward()
        models, losses = {}, {}
        for name, cfg in cfgs.items():
            models[name] = build_model(cfg).to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev == "cuda"):
                losses[name] = models[name](tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
            losses[name].backward()
        return got, mix, [t.grad for t in leaves], losses, models["dense"]

    # Compile fla's kernels for everything below at once (minutes otherwise: see triton_compile).
    compile_ahead(gpu_side, label="gpu_check")
    got, got_mix, mix_grads, gpu_losses, gpu_model = gpu_side()

    torch.manual_seed(0)
    ref = KimiDeltaAttention(hidden_size=256, num_heads=4, head_dim=64)(x)
    out["kda_layer_rel_err"] = rel_err(got, ref)

    # AttnRes depth mixing: the dispatched kernel vs the torch reference, value and gradients,
    # on mixed-dtype sources as autocast produces them (fp32 blocks, a bf16 partial sum).
    out["attnres_backend"] = attnres_backend(dev)
    leaves = [t.clone().requires_grad_() for t in [q0, *src0]]
    ref_mix = depth_mix_torch(leaves[0], [*leaves[1:4], leaves[4].bfloat16().float()], 1e-6)
    (ref_mix * w).sum().backward()
    out["attnres_rel_err"] = rel_err(got_mix, ref_mix)
    out["attnres_worst_grad_cosine"] = min(cosine(a, b.grad) for a, b in zip(mix_grads, leaves))

    # The whole model, k3_tiny as shipped (MoE): loss. Then its dense twin (every FFN dense, so
    # that a near-tie in the router flipping under bf16 cannot move whole tokens between experts):
    # every parameter gradient.
    for name, cfg in cfgs.items():
        model = build_model(cfg)
        loss_cpu = model(tokens[:, :-1], tokens[:, 1:])
        loss_cpu.backward()
        out[f"{name}_loss_cpu"], out[f"{name}_loss_gpu"] = loss_cpu.item(), gpu_losses[name].item()
    cpu_grads = dict(model.named_parameters())
    pairs = [(n, p.grad, cpu_grads[n].grad) for n, p in gpu_model.named_parameters()
             if p.grad is not None and cpu_grads[n].grad.norm() > 0]
    out["dense_grad_cosine_all"] = cosine(torch.cat([g.flatten().cpu() for _, g, _ in pairs]),
                                          torch.cat([r.flatten() for _, _, r in pairs]))
    per = sorted((cosine(g, r), n, r.numel()) for n, g, r in pairs)
    out["dense_worst_grads"] = per[:5]
    # Small vectors (A_log [H], AttnRes queries [D], norm weights) are sums over every token of
    # terms that cancel to a few percent of their absolute sum, so bf16 noise can flip their
    # direction (an H200 run measured cosine -0.41 on a 4-element A_log while the loss agreed to
    # 5e-3): they are reported, and the gate is on matrices of at least 4096 elements.
    big = [c for c, _, numel in per if numel >= 4096]
    out["dense_worst_matrix_grad_cosine"] = min(big)
    if dev == "cuda":
        out.update(conv_check())
        out.update(muon_check())
        out.update(topk_check())
        out.update(graph_check(tokens))
        for mode in ("selective", "full"):
            out.update(graph_check(tokens, recompute=mode))
    ok = (out.get("graph_ok", True) and out.get("graph_selective_ok", True) and out.get("graph_full_ok", True) and out["kda_layer_rel_err"] < 2e-2
          and all(out.get(k, 0.0) < 2e-2 for k in ("conv_rel_err", "conv_dx_rel_err", "conv_dw_rel_err",
                                                     "muon_rel_err"))
          and "conv_error" not in out and "topk_error" not in out
          and out.get("topk_values_equal", True) and out.get("topk_indices_equal_untied", True)
          and out["attnres_rel_err"] < 1e-4
          and out["attnres_worst_grad_cosine"] > 0.9999
          and abs(out["model_loss_gpu"] - out["model_loss_cpu"]) < 2e-2
          and abs(out["dense_loss_gpu"] - out["dense_loss_cpu"]) < 2e-2
          and out["dense_grad_cosine_all"] > 0.99 and out["dense_worst_matrix_grad_cosine"] > 0.99)
    out["ok"] = ok
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
