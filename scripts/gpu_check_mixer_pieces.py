"""The mixers run in token pieces on the GPU (``train.recompute_pieces``), against fp64.

One ``KimiDeltaAttention`` and one ``GatedMLA`` layer at k3_mini's widths on two rows of
``--seq-len`` tokens with documents (one starting at a piece's first token, one inside the next
piece's conv halo, one running across every piece boundary), run in fp32 on the GPU two ways:
whole, and in ``--pieces`` pieces chained as ``k3train/model/recompute.py`` chains them. KDA:
``forward_piece`` with each piece's halo and the state after the piece before (fla's varlen
``chunk_kda`` with per-document initial states, our conv kernel). MLA: the whole window's
latent, then each piece's queries against the keys of its prefix (SDPA, lower-right causal,
one call per document). Reference: the whole layer in fp64 on the CPU (the torch forms).
Reported per layer: relative L2 errors of the output and of the input's and every parameter's
gradient, for the pieces and for the whole call (the kernels' own rounding: fla's dots run in
tf32):

    python scripts/gpu_check_mixer_pieces.py [--seq-len 8192] [--pieces 4] [--json OUT]

Gate: every error of the pieces below 1e-2 and within 4x of the whole call's (or below 1e-4).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

from k3train.model.kda_layer import KimiDeltaAttention
from k3train.model.mixer_pieces import attention_piece, mixer_piece, piece_bounds
from k3train.model.mla import GatedMLA
from k3train.runtime.distributed import init_distributed


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def documents(seq_len: int, pieces: int) -> torch.Tensor:
    """cu_seqlens over two rows: row 0 has a start at its second piece's first token and one
    two tokens into the third piece's halo; row 1 one document across every piece boundary."""
    bounds = piece_bounds(seq_len, pieces)
    s1, s2 = bounds[1][0], bounds[min(2, pieces - 1)][0]
    row0 = sorted({0, s1, max(s1 + 1, s2 - 1)})
    return torch.tensor(row0 + [seq_len, 2 * seq_len])


def layers() -> dict[str, torch.nn.Module]:
    """k3_mini's KDA and MLA layers (fp64, seeded)."""
    torch.manual_seed(0)
    return {"kda": KimiDeltaAttention(hidden_size=1024, num_heads=8, head_dim=128).double(),
            "mla": GatedMLA(hidden_size=1024, num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128).double()}


def pieced(layer, x: torch.Tensor, cu: torch.Tensor, pieces: int) -> torch.Tensor:
    """The layer over ``x`` ``[B, T, D]`` in pieces, chained as recompute._mixer_in_pieces /
    _attention_in_pieces chain them."""
    B, T = x.shape[:2]
    bounds = piece_bounds(T, pieces)
    outs = []
    if isinstance(layer, GatedMLA):
        latent = layer.latent(x)
        for s, e in bounds:
            piece = attention_piece(s, e, cu_seqlens=cu, batch=B, seq_len=T)
            outs.append(layer.forward_piece(x[:, s:e], piece, latent[:, :e])[0])
        return torch.cat(outs, dim=1)
    state = None
    for j, (s, e) in enumerate(bounds):
        piece = mixer_piece(s, e, halo=layer.halo, hand_over=j < len(bounds) - 1, cu_seqlens=cu, batch=B,
                            seq_len=T, device=x.device)
        out, state = layer.forward_piece(x[:, s - piece.halo:e], piece, state)
        outs.append(out)
    return torch.cat(outs, dim=1)


def run(layer, x, cu, pieces: int | None, w):
    """(output, gradient of x, gradients of the parameters) of (output * w).sum()."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x, cu) if pieces is None else pieced(layer, x, cu, pieces)
    (y.double() * w.to(y.device)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def check(ref_layer, x, w, cu, pieces: int, device: str) -> dict:
    """{"whole": errors, "pieces": errors, "pass": bool} of one layer."""
    ref = run(ref_layer, x, cu, None, w)
    gpu_layer = copy.deepcopy(ref_layer).float().to(device)
    results = {}
    for name, p in (("whole", None), ("pieces", pieces)):
        y, dx, grads = run(gpu_layer, x.float().to(device), cu.to(device), p, w)
        errs = {"out": rel(y, ref[0]), "dx": rel(dx, ref[1])}
        errs.update({n: rel(g, ref[2][n]) for n, g in grads.items()})
        results[name] = errs
    results["pass"] = all(e < 1e-2 and (e <= 4 * results["whole"][k] or e < 1e-4)
                          for k, e in results["pieces"].items())
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--pieces", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu runs the torch forms in fp32 (the script's own check)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check_mixer_pieces: needs a CUDA device", file=sys.stderr)
        return 2
    init_distributed(device=args.device)   # the tensor-parallel groups the layers read (TP=1)
    T = args.seq_len
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, T, 1024, dtype=torch.float64, generator=gen)
    w = torch.randn(2, T, 1024, dtype=torch.float64, generator=gen)
    cu = documents(T, args.pieces)
    print(f"documents {cu.tolist()}; pieces {piece_bounds(T, args.pieces)}")
    out = {"seq_len": T, "pieces": args.pieces, "documents": cu.tolist()}
    for kind, layer in layers().items():
        res = check(layer, x, w, cu, args.pieces, args.device)
        out[kind] = res
        for k in ["out", "dx", *sorted(k for k in res["whole"] if k not in ("out", "dx"))]:
            print(f"  {kind} {k:<22} whole {res['whole'][k]:.2e}  pieces {res['pieces'][k]:.2e}")
        print(f"{kind}: {'PASS' if res['pass'] else 'FAIL'}")
    out["pass"] = all(out[k]["pass"] for k in ("kda", "mla"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
