"""Document masking on the GPU (fla's varlen kernels) against the CPU reference in fp64.

A batch of ``[2, --seq]`` tokens cut into documents of random lengths (``cu_seqlens``) goes
through, on CUDA with ``kernels.kda=fla`` and ``kernels.short_conv=fla``:

* ``kda``: ``kda_gated(..., cu_seqlens=)``, i.e. ``k3train.ops.kda.fla_kda_varlen`` (fla's
  ``chunk_kda`` with the batch flattened to one row);
* ``conv``: ``short_conv_silu(..., cu_seqlens)`` (fla's ``causal_conv1d`` varlen);
* ``mla``: ``GatedMLA`` with the block-diagonal causal SDPA mask;

each output and each input gradient against the same call on the CPU in fp64 (the torch forms:
KDA per document, the masked conv, the same mask), reported as relative L2 error. A second KDA
line runs the GPU call unmasked on the same batch, to show the mask matters (its error is large).
Gate: every masked error below 2e-2 in bf16 (fla's dots run in tf32 on fp32 inputs and in bf16
here; the unmasked KDA line is reported, not gated).

A second part (``graphed``, on CUDA) records KDA, conv and MLA with their gradients in one CUDA
graph on fixed-shape boundaries (``document_cu_seqlens_padded``'s form: the documents, then
zero-length ones), copies another batch's boundaries into the buffer, replays, and compares with
the eager calls on that batch's exact boundaries (same kernels: gate 1e-3 relative, the conv's
weight gradient sums a different count of zero partials); the replay against the capture's own
boundaries is reported to show the buffer was read (its error is large).

    python scripts/gpu_check_document_mask.py [--seq 1024] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from k3train.config.schema import KernelsConfig
from k3train.data.documents import max_documents
from k3train.model.mla import GatedMLA
from k3train.ops import kernels
from k3train.ops.kda import kda_gated
from k3train.ops.short_conv import short_conv_silu
from k3train.runtime.distributed import init_distributed


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cu_seqlens(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Every row start plus random document starts inside the rows -> [N+1] int64."""
    starts = {r * seq for r in range(batch)}
    for r in range(batch):
        starts |= {r * seq + int(t) for t in torch.randint(1, seq, (max(1, seq // 200),), generator=gen)}
    return torch.tensor(sorted(starts) + [batch * seq])


def compare(fn, inputs: list[torch.Tensor], cu: torch.Tensor, device: str, dtype) -> dict:
    """fn(*inputs, cu) on ``device`` in ``dtype`` against the CPU in fp64: output and grads."""
    out = {}
    runs = []
    for dev, dt in ((device, dtype), ("cpu", torch.float64)):
        xs = [x.detach().to(dev, dt).requires_grad_() for x in inputs]
        y = fn(*xs, cu.to(dev))
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dev, y.dtype)
        grads = torch.autograd.grad((y * w).sum(), xs)
        runs.append((y, grads))
    (y, g), (y_ref, g_ref) = runs
    out["out"] = rel(y, y_ref)
    for i, (a, b) in enumerate(zip(g, g_ref)):
        out[f"grad{i}"] = rel(a, b)
    return out


def padded(cu: torch.Tensor, max_docs: int) -> torch.Tensor:
    """cu [N+1] -> [max_docs + 1]: the documents, then zero-length ones at the end."""
    return torch.cat([cu, cu[-1:].expand(max_docs + 1 - cu.numel())])


def graphed(B: int, T: int, H: int, K: int, D: int, gen: torch.Generator, dtype) -> dict:
    """KDA + conv + MLA forward and backward recorded once, replayed on other boundaries."""
    dev = "cuda"
    rn = lambda *s: torch.randn(*s, generator=gen).to(dev, dtype)  # noqa: E731
    A_log, dt_bias = rn(H).float(), rn(H, K).float()
    conv_w = rn(3 * H * K, 4)
    torch.manual_seed(0)
    mla = GatedMLA(hidden_size=D, num_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                   qk_rope_head_dim=16, v_head_dim=32).to(dev, dtype)
    xs = [rn(B, T, H, K), rn(B, T, H, K), rn(B, T, H, K), rn(B, T, H, K), rn(B, T, H), rn(B, T, 3 * H * K),
          rn(B, T, D)]
    xs = [x.requires_grad_() for x in xs]
    ws = [rn(B, T, H, K), rn(B, T, 3 * H * K), rn(B, T, D)]

    def step(cu):
        q, k, v, f, b, xc, xm = xs
        outs = [kda_gated(q, k, v, f, b, A_log, dt_bias, -5.0, cu_seqlens=cu), short_conv_silu(xc, conv_w, cu),
                mla(xm, cu)]
        loss = sum((o.float() * w.float()).sum() for o, w in zip(outs, ws))
        return [o.detach() for o in outs] + list(torch.autograd.grad(loss, xs))

    max_docs = max_documents(B, T)
    cu_a, cu_b = cu_seqlens(B, T, gen).to(dev), cu_seqlens(B, T, gen).to(dev)
    static_cu = padded(cu_a, max_docs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):     # warm-up off the capture stream (autotuning, allocator)
        for _ in range(2):
            step(static_cu)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = step(static_cu)
    static_cu.copy_(padded(cu_b, max_docs))
    graph.replay()
    replayed = [t.clone() for t in recorded]
    names = ["kda", "conv", "mla", "dq", "dk", "dv", "dg", "dbeta", "dx_conv", "dx_mla"]
    # copies: a result that aliases a reused buffer must not be read after a later call
    eager_b = [t.clone() for t in step(cu_b)]
    eager_a = [t.clone() for t in step(cu_a)]
    return {"documents": [cu_a.numel() - 1, cu_b.numel() - 1], "max_documents": max_docs,
            "replay_vs_eager": {n: rel(r, e) for n, r, e in zip(names, replayed, eager_b)},
            "replay_vs_capture_boundaries": max(rel(r, e) for r, e in zip(replayed, eager_a))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu only dry-runs the script (torch forms)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    init_distributed(device=args.device)   # the model-parallel groups GatedMLA reads (TP=1)
    if args.device == "cuda":
        kernels.apply(KernelsConfig(kda="fla", short_conv="fla", autotune="fixed"), pipeline_gpu=False)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, D = 2, args.seq, 4, 64, 256
    cu = cu_seqlens(B, T, gen)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    A_log, dt_bias = rn(H), rn(H, K)

    def kda_fn(q, k, v, f, b, c):
        return kda_gated(q, k, v, f, b, A_log.to(q.device), dt_bias.to(q.device), -5.0, cu_seqlens=c)

    kda_in = [rn(B, T, H, K), rn(B, T, H, K), rn(B, T, H, K), rn(B, T, H, K), rn(B, T, H)]
    result = {"seq": T, "documents": len(cu) - 1, "kda": compare(kda_fn, kda_in, cu, args.device, dtype)}
    # the GPU call without boundaries against the masked reference: must be far off
    def kda_unmasked_on_device(q, k, v, f, b, c):
        on_device = q.device.type != "cpu" or q.dtype != torch.float64
        return kda_fn(q, k, v, f, b, None if on_device else c)

    result["kda_unmasked_vs_masked"] = compare(kda_unmasked_on_device, kda_in, cu, args.device, dtype)["out"]
    w = rn(3 * H * K, 4)
    result["conv"] = compare(lambda x, wt, c: short_conv_silu(x, wt, c), [rn(B, T, 3 * H * K), w], cu,
                             args.device, dtype)
    def mla_fn(x, c):   # the same fp32 weights on both sides (same seed), then cast
        torch.manual_seed(0)
        mla = GatedMLA(hidden_size=D, num_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                       qk_rope_head_dim=16, v_head_dim=32)
        return mla.to(x.device, x.dtype)(x, c)

    result["mla"] = compare(mla_fn, [rn(B, T, D)], cu, args.device, dtype)
    if args.device == "cuda":
        result["graphed"] = graphed(B, T, H, K, D, gen, dtype)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    worst = max(v for part in ("kda", "conv", "mla") for v in result[part].values())
    ok = worst < 2e-2
    print(f"{'PASS' if ok else 'FAIL'}: worst masked relative error {worst:.2e} (gate 2e-2)")
    if "graphed" in result:
        g = result["graphed"]
        worst_g = max(g["replay_vs_eager"].values())
        ok_g = worst_g < 1e-3 and g["replay_vs_capture_boundaries"] > 1e-2
        print(f"{'PASS' if ok_g else 'FAIL'}: graphed replay on new boundaries vs eager {worst_g:.2e} (gate 1e-3); "
              f"vs the capture's boundaries {g['replay_vs_capture_boundaries']:.2e} (must exceed 1e-2)")
        ok &= ok_g
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
