"""The memory planner's CUDA-kernel CP terms against the CUDA allocator, on one GPU.

A one-rank context-parallel group runs the CP code paths on one device (the all-gathers are
trivial, every kernel call and kept tensor is the ranks' own): one K3-width KDA layer and one
MLA layer each run a training forward under bf16 autocast, without CP and with it, on the same
``--tokens`` tokens, and the bytes the forward leaves allocated (what autograd keeps for
backward; the output excluded) are compared. What CP adds on the one rank against the plan
(``k3train/profiling``, ops ``fused``, bf16):

- KDA: the fold's states and fla's ``[0, I]`` seed (``kda_fold_state_bytes`` at one piece), and
  per token v's K more columns and the correction's copy of ``q~`` (``kda_cp_bytes_per_token``);
- MLA: the explicit mask's additive bias that SDPA's fused kernel keeps (cuDNN attention on
  torch 2.11), ``[T, T]`` in bf16 (with one rank the expanded keys are the rank's own: no
  key-side term); and the document path's ``[B, T, T]`` (``data.document_mask=true``).

SDPA alone (no project code) was measured on an H200 with torch 2.11 on 2026-12-04: an explicit
mask over 8,192 queries and 16,384 keys kept 259 MiB beyond the output against 3 MiB for the
causal call, the 256 MiB bf16 bias; the bool mask is not kept. The correction's einsum under
CUDA autocast saved exactly q~ in bf16 (192 MiB at 8,192 tokens, 96 heads of 128) and S in
bf16. This script (the whole layers, fla's chunk_kda included) needs fla and the project's
dependencies, which that machine did not have: not run yet.

    python scripts/gpu_check_cp_memory.py [--tokens 8192] [--json OUT]

PASS: each measured extra within 10% of the planned (the CPU gate of the KDA layer; the MLA
mask had no measurement before). Outputs go under ``$OUT`` when set. About a minute on an H200
after fla's kernels compile (``kernels.autotune=fixed``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from k3train.config import load_config
from k3train.model.model import build_model
from k3train.ops import kernels
from k3train.profiling.activation_bytes import Widths, kda_cp_bytes_per_token
from k3train.runtime.distributed import init_distributed


def _kept(mixer, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    """Bytes a forward of ``mixer`` leaves allocated on the GPU beyond its output."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mixer(x, cu_seqlens) if cu_seqlens is not None else mixer(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    y.float().sum().backward()
    del y
    x.grad = None
    for p in mixer.parameters():
        p.grad = None
    torch.cuda.synchronize()
    return kept


def _layer(cfg):
    model = build_model(cfg).cuda()
    return model, model.layers[0].mixer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    init_distributed(device="cuda")
    group = dist.new_group([0])
    T = args.tokens
    report, ok = {"tokens": T, "device": torch.cuda.get_device_name()}, True
    with kernels.using(autotune="fixed"):
        for kind, docs in (("K", False), ("M", False), ("M", True)):
            cfg = load_config("configs/k3_full.yaml", [
                "model.num_layers=1", f"model.layer_pattern={kind}", "model.dense_layers=1",
                f"train.seq_len={T}", "train.micro_batch_size=1", f"data.document_mask={str(docs).lower()}"])
            torch.manual_seed(0)
            model, mixer = _layer(cfg)
            x = torch.randn(1, T, cfg.model.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            cu = torch.tensor([0, T], device="cuda", dtype=torch.int32) if docs else None
            _kept(mixer, x, cu)                      # warm-up: kernels compiled, workspaces made
            alone = _kept(mixer, x, None)            # the plain path (flash or efficient, causal)
            model.use_context_parallel(group, None, "contiguous")
            _kept(mixer, x, cu)
            with_cp = _kept(mixer, x, cu)
            model.use_context_parallel(None, None, "contiguous")
            w, a = Widths.of(cfg), 2
            if kind == "K":
                states = w.H * w.K * (2 * w.K + w.K) * 4      # S_p and the [E, M] storage, one piece
                seed = w.H * w.K * (w.K + w.K) * 4
                planned = states + seed + T * kda_cp_bytes_per_token(w, T, a, "fused")
            else:
                planned = T * T * a                             # the bias, [T, T] or [1, T, T]
            extra = with_cp - alone
            name = {"K": "kda", "M": "mla"}[kind] + ("_documents" if docs else "")
            report[name] = {"alone": alone, "cp": with_cp, "extra": extra, "planned": planned,
                            "ratio": extra / planned}
            ok &= abs(extra / planned - 1) <= 0.10
            print(f"{name}: kept {alone / 2**20:.1f} MiB alone, {with_cp / 2**20:.1f} MiB under CP: "
                  f"extra {extra / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB ({extra / planned:.3f})")
            del model, mixer, x
            torch.cuda.empty_cache()
    report["pass"] = bool(ok)
    print("PASS" if ok else "FAIL")
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check_cp_memory.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
