"""Muon's Newton-Schulz on one GPU: our Triton GEMM (reads C in its epilogue) against
torch.baddbmm (copies C into its output first), side by side on the same data.

    python3 -m benchmarks.bench_muon [--json out.json]
    python3 -m benchmarks.bench_muon --slice [--slice-json bench_slice.json] [--json out.json]
    python3 -m benchmarks.bench_muon --slice --device cpu --small       # CPU dry run
    python3 -m benchmarks.bench_muon --gram-flops [--json out.json]     # FLOPs only (any machine)

Rows: one ``baddbmm`` of each Newton-Schulz kind on k3_mini's expert stack ``[512, 512, 512]``
bf16 (the Gram product, ``b A + c A A`` and ``a X + B X``), then the whole 5-step
``newton_schulz`` on each k3_mini Muon shape, with the relative difference between the two
backends and each one's error against an fp32 iteration.

``--slice``: Muon at K3's widths (configs/k3_slice.yaml). The Muon matrices of the slice come
from the trainer's own parameter table (``k3train.trainer.optimizer``, per-head q/k/v and
q_up/kv_up), built on the meta device; one update (momentum, Newton-Schulz, apply) of each
distinct (shape, heads) is timed on this GPU and multiplied by how many the model has. Then
ZeRO-1: ``optim.sharded.plan_muon_owners`` (the ownership the sharded optimizer uses; each owner
orthogonalises only its own matrices) assigns the matrices at DP = 1, 2, 4, 8, and each rank's
Newton-Schulz time is the sum of its matrices' measured times (the slowest rank sets the step).
With ``--slice-json`` (bench_slice.py's output: measured forward+backward per token) it also
gives Muon's share of a step at 256K tokens per update, EXTRAPOLATED from those measured parts:
``ns_rank / (fwd_bwd_per_token * 256K / DP + ns_rank)``.

Then the replicated optimizer's distributed Muon (``optim.muon_distributed``, config
``optim.muon_distributed``): Newton-Schulz blocks (whole matrices, per-head blocks, single
experts) assigned by ``plan_ns_owners`` at DP = 1, 2, 4, 8 (experts over expert-DP = DP at
EP=1). Side by side per rank: Newton-Schulz GFLOP replicated (every rank all blocks) and
distributed (slowest / least-loaded owner), the measured Newton-Schulz time of the replicated
set (the DP=1 row) and of the slowest owner's share, each run on this one device as the owner
batches it, and the bytes one rank receives in the step's all-gather of updates (computed from
the plan, bf16 on CUDA; its time is not measured on one device).

``--gram-flops`` (no device work; also printed after ``--slice``): per slice Muon shape, the
Newton-Schulz FLOPs of the standard and the Gram form (``optim.ns_gram``), the form
``optim.muon_ns=auto`` picks, and Muon's share of a step at 256K tokens per update if auto were
used, PREDICTED from FLOPs alone: Newton-Schulz at the measured 790 TFLOP/s matmul rate against
the measured 16.24 s forward+backward at 256K tokens (benchmarks/2026-12-04_h200_fresh-decode-muon.md).
``--slice`` on a GPU also times one update of each shape auto sends to the Gram form under
``muon_ns=auto`` (measured) and its difference from the standard update.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import torch

from benchmarks.common import graph_ms, save_json, timeit  # noqa: E402

import optim.muon as muon  # noqa: E402
from k3train.config import load_config  # noqa: E402
from k3train.model.model import build_model  # noqa: E402
from k3train.runtime.distributed import init_distributed  # noqa: E402
from k3train.trainer.optimizer import _EXPERTS, k3_param_rules  # noqa: E402
from optim import build_param_table  # noqa: E402
from optim.sharded import plan_muon_owners  # noqa: E402
from optim.muon_distributed import gather_bytes, muon_blocks, plan_ns_owners  # noqa: E402
from k3train.ops import kernels  # noqa: E402
from optim.ns_gemm_triton import baddbmm_triton  # noqa: E402
from optim.ns_gram import ns_flops_gram, ns_flops_standard, use_gram  # noqa: E402

# (stack size, rows, cols) of k3_mini's Muon batches: expert stacks, attention and dense FFN.
SHAPES = [(512, 512, 512), (32, 1024, 1024), (30, 1024, 2048), (15, 2048, 1024)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ns_with(backend: str, G: torch.Tensor) -> torch.Tensor:
    with kernels.using(ns_gemm=backend):
        return muon.newton_schulz(G)


def ns_flops(shape: tuple[int, ...], heads: int | None, steps: int = 5) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz steps on ``shape`` (``[A, B]`` or ``[S, A, B]``,
    split into ``heads`` row blocks): ``optim.muon.ns_flops`` per block times the blocks."""
    n, rows, cols = muon_blocks(shape, heads)
    return n * muon.ns_flops(rows, cols, steps)


def owner_share(matrices: list[tuple[tuple[int, ...], int | None]], world: int) -> list[dict]:
    """Each rank's blocks under ``DistributedMuon``'s plan (``plan_ns_owners``) for Muon
    parameters ``(shape, heads)`` replicated over ``world`` ranks: per rank, a Counter of block
    shapes ``(rows, cols) -> count`` and its Newton-Schulz FLOPs."""
    blocks = []
    for shape, heads in matrices:
        n, rows, cols = muon_blocks(shape, heads)
        blocks += [(rows, cols)] * n
    owners = plan_ns_owners([muon.ns_flops(r, c) for r, c in blocks], world)
    share = [{"blocks": Counter(), "flops": 0} for _ in range(world)]
    for (r, c), o in zip(blocks, owners):
        share[o]["blocks"][(r, c)] += 1
        share[o]["flops"] += muon.ns_flops(r, c)
    return share


def time_blocks(blocks, device: str, gen) -> float:
    """Measured ms of Newton-Schulz on ``blocks`` (``(rows, cols) -> count``), batched per
    shape in runs of at most ``optim.muon``'s batch cap, as ``DistributedMuon`` stacks them:
    one full run is timed and multiplied, so memory stays at one run."""
    total = 0.0
    for (rows, cols), count in blocks.items():
        per = max(1, muon._BATCH_ELEMS // (rows * cols))
        full, rest = divmod(count, per)
        for k, times in ((per, full), (rest, 1)):
            if k == 0 or times == 0:
                continue
            G = torch.randn(k, rows, cols, device=device, generator=gen)
            total += times * timeit(lambda: muon.newton_schulz(G, out_scale=-1e-3), warmup=1, iters=3, device=device)
            del G
    return total


# Measured on one H200 (benchmarks/2026-12-04_h200_fresh-decode-muon.md): the bf16 matmul rate
# the run measured, and the slice's forward+backward at 256K tokens per update (1,014.8 ms per
# 16,384 tokens, times 16). The Gram prediction divides FLOPs by the first: PREDICTED.
MEASURED_MATMUL_TFLOPS = 790.0
MEASURED_FWD_BWD_S_256K = 16.24


def gram_prediction(kinds: Counter, steps: int = 5) -> dict:
    """Per slice Muon shape ``(shape, heads) -> count``: Newton-Schulz FLOPs of the standard and
    the Gram form (per block times blocks times count), auto's pick, and the totals with their
    PREDICTED share of a step at 256K tokens (FLOPs at the measured matmul rate)."""
    rows = []
    for (shape, heads), count in sorted(kinds.items(), key=lambda kv: -ns_flops(*kv[0])):
        n, r, c = muon_blocks(shape, heads)
        std, gram = n * ns_flops_standard(r, c, steps), n * ns_flops_gram(r, c, steps)
        rows.append({"shape": list(shape), "heads": heads, "count": count, "block": [r, c],
                     "standard_tflop": count * std / 1e12, "gram_tflop": count * gram / 1e12,
                     "auto": "gram" if use_gram("auto", r, c, steps) else "standard"})
    std = sum(x["standard_tflop"] for x in rows)
    auto = sum(x["gram_tflop"] if x["auto"] == "gram" else x["standard_tflop"] for x in rows)

    def share(tflop: float) -> float:
        ns_s = tflop / MEASURED_MATMUL_TFLOPS
        return ns_s / (MEASURED_FWD_BWD_S_256K + ns_s)

    # For comparison, another cheaper iteration: one quintic step fewer on every block (its own
    # coefficients would be needed to keep the band; not implemented, FLOPs only).
    fewer = std * (steps - 1) / steps
    return {"rows": rows, "standard_tflop": std, "auto_tflop": auto, "predicted": True,
            "standard_one_step_fewer_tflop": fewer, "share_256k_one_step_fewer": share(fewer),
            "matmul_tflops_measured": MEASURED_MATMUL_TFLOPS, "fwd_bwd_s_256k_measured": MEASURED_FWD_BWD_S_256K,
            "share_256k_standard": share(std), "share_256k_auto": share(auto)}


def print_gram(pred: dict) -> None:
    print(f"\n{'Gram Newton-Schulz (optim.muon_ns)':<34}")
    print(f"{'shape':<22}{'heads':>6}{'count':>6}{'block':>14}{'std TFLOP':>11}{'gram TFLOP':>12}{'ratio':>7}{'auto':>10}")
    for x in pred["rows"]:
        print(f"{str(x['shape']):<22}{str(x['heads'] or '-'):>6}{x['count']:>6}{str(x['block']):>14}"
              f"{x['standard_tflop']:>11.2f}{x['gram_tflop']:>12.2f}{x['standard_tflop'] / x['gram_tflop']:>6.2f}x"
              f"{x['auto']:>10}")
    print(f"Newton-Schulz per update: standard {pred['standard_tflop']:.1f} TFLOP, auto {pred['auto_tflop']:.1f} TFLOP")
    print(f"Muon share of the step at 256K tokens/update, PREDICTED (FLOPs at the measured "
          f"{pred['matmul_tflops_measured']:.0f} TFLOP/s, measured fwd+bwd {pred['fwd_bwd_s_256k_measured']:.2f} s): "
          f"standard {pred['share_256k_standard']:.2%}, auto {pred['share_256k_auto']:.2%} (target 4%); "
          f"for comparison one standard step fewer ({pred['standard_one_step_fewer_tflop']:.1f} TFLOP): "
          f"{pred['share_256k_one_step_fewer']:.2%}")


def slice_table(args):
    """The slice's Muon parameter table (on the meta device) and its config."""
    small = ["model.hidden_size=64", "model.kda.num_heads=2", "model.kda.head_dim=32", "model.mla.num_heads=2",
             "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16",
             "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16", "moe.num_experts=8", "moe.topk=2",
             "moe.latent_size=32", "moe.expert_ffn_size=32", "moe.shared_ffn_size=64"] if args.small else []
    cfg = load_config(args.config, small)
    init_distributed()
    with torch.device("meta"):
        model = build_model(cfg)
    return [e for e in build_param_table(model.named_parameters(), k3_param_rules(model, cfg.optim.muon_per_head))
            if e.optimizer == "muon"]


def slice_muon(args) -> dict:
    """The slice's Muon matrices: time per update of each distinct shape, ZeRO-1 per-rank times."""
    table = slice_table(args)
    kinds = Counter((tuple(e.shape), e.heads) for e in table)
    dev = torch.device(args.device)
    ms_of, rows = {}, []
    gen = torch.Generator(device=dev).manual_seed(0)
    for (shape, heads), count in sorted(kinds.items(), key=lambda kv: -ns_flops(*kv[0])):
        g = torch.randn(shape, device=dev, generator=gen)
        buf = torch.zeros_like(g)
        p = torch.zeros_like(g)

        def update():
            ups = muon.muon_updates([g], [buf], momentum=0.95, nesterov=True, heads=heads, ns_steps=5, alpha=-1e-3)
            muon.apply_muon_updates([p], ups, 1.0 - 1e-4)

        ms = timeit(update, warmup=1, iters=3, device=args.device)
        ms_of[(shape, heads)] = ms
        tf = ns_flops(shape, heads)
        rows.append({"shape": list(shape), "heads": heads, "count": count, "ms_each": ms, "tflop_each": tf / 1e12,
                     "tflops": tf / (ms * 1e-3) / 1e12})
        print(f"{str(list(shape)):<22}{str(heads or '-'):>6}{count:>6}{ms:>10.2f}{tf / 1e12:>9.2f}"
              f"{tf / (ms * 1e-3) / 1e12:>9.0f}{count * ms:>10.1f}", flush=True)
        _, r, c = muon_blocks(shape, heads)
        if use_gram("auto", r, c):  # measured: the same update under muon_ns=auto (the Gram form)
            kw = dict(momentum=0.0, nesterov=False, heads=heads, ns_steps=5, alpha=-1e-3)
            ref = muon.muon_updates([g], [torch.zeros_like(g)], **kw)[0]
            got = muon.muon_updates([g], [torch.zeros_like(g)], ns_mode="auto", **kw)[0]
            rows[-1]["auto_ms_each"] = timeit(lambda: muon.muon_updates([g], [buf], ns_mode="auto", **kw),
                                              warmup=1, iters=3, device=args.device)
            rows[-1]["auto_rel_diff"] = rel(got, ref)
            print(f"{'  muon_ns=auto (gram):':<34}{rows[-1]['auto_ms_each']:>10.2f} ms each (measured), "
                  f"rel diff to standard {rows[-1]['auto_rel_diff']:.1e}", flush=True)
        del g, buf, p
    total = sum(r["count"] * r["ms_each"] for r in rows)
    out = {"config": args.config, "matrices": rows, "muon_ms_per_update": total,
           "muon_tflop_per_update": sum(r["count"] * r["tflop_each"] for r in rows), "zero1": {}}
    # ZeRO-1 as ShardedOptimizer plans it at EP=1: dense matrices over DP, routed-expert stacks
    # over expert-DP (the same ranks at EP=1), each domain planned on its own.
    times = [ms_of[(tuple(e.shape), e.heads)] for e in table]
    expert = [bool(re.search(_EXPERTS, e.name)) for e in table]
    fb_per_token = None
    if args.slice_json:
        with open(args.slice_json) as f:
            sl = json.load(f)
        r = sl["rows"].get("muon") or next(iter(sl["rows"].values()))
        fb_per_token = r["fwd_bwd_ms"] / r["tokens_per_update"]
        out["fwd_bwd_ms_per_token"] = fb_per_token
    for dp in (1, 2, 4, 8):
        per_rank = [0.0] * dp
        for want in (False, True):
            idx = [i for i in range(len(table)) if expert[i] == want]
            owners = plan_muon_owners([table[i].param.numel() for i in idx], dp)
            for i, o in zip(idx, owners):
                per_rank[o] += times[i]
        z = {"per_rank_ms": per_rank, "max_ms": max(per_rank), "ideal_ms": total / dp}
        if fb_per_token is not None:
            fb = fb_per_token * EXTRAPOLATE_TOKENS / dp
            z["extrapolated_256k"] = {"fwd_bwd_ms_per_rank": fb, "muon_share_of_step": z["max_ms"] / (fb + z["max_ms"]),
                                      "extrapolated": True}
        out["zero1"][dp] = z
    out["distributed"] = distributed_muon(table, expert, dev, gen)
    out["gram"] = gram_prediction(kinds)
    return out


def distributed_muon(table, expert: list[bool], dev: torch.device, gen) -> dict:
    """optim.muon_distributed at DP = 1, 2, 4, 8 (EP=1: experts over expert-DP = DP): per rank
    the Newton-Schulz FLOPs, replicated against the owner plan, and the measured Newton-Schulz
    time of the slowest owner's share (run here on one device); bytes one rank receives in the
    step's all-gather of updates (bf16 on CUDA, fp32 on CPU)."""
    mats = {want: [(tuple(e.shape), e.heads) for e, x in zip(table, expert) if x == want] for want in (False, True)}
    elem = 2 if dev.type == "cuda" else 4
    replicated_ms, out = None, {}
    for dp in (1, 2, 4, 8):
        shares = {want: owner_share(mats[want], dp) for want in (False, True)}
        per_rank = [shares[False][r]["flops"] + shares[True][r]["flops"] for r in range(dp)]
        slow = max(range(dp), key=lambda r: per_rank[r])
        blocks = Counter(shares[False][slow]["blocks"]) + Counter(shares[True][slow]["blocks"])
        ms = time_blocks(blocks, dev.type, gen)
        replicated_ms = ms if dp == 1 else replicated_ms
        nbytes = sum(gather_bytes(mats[want], dp, element_size=elem) for want in (False, True))
        out[dp] = {"replicated_tflop_per_rank": sum(per_rank) / 1e12,  # every rank all blocks
                   "distributed_tflop_per_rank_max": max(per_rank) / 1e12,
                   "distributed_tflop_per_rank_min": min(per_rank) / 1e12,
                   "ns_ms_slowest_owner": ms, "ns_ms_replicated": replicated_ms,
                   "allgather_bytes_per_rank": nbytes}
    return out


EXTRAPOLATE_TOKENS = 256 * 1024


def print_slice(out: dict) -> None:
    print(f"\nMuon per update: {out['muon_ms_per_update']:.1f} ms, {out['muon_tflop_per_update']:.1f} TFLOP "
          f"({len(out['matrices'])} shapes)")
    share = "fwd_bwd_ms_per_token" in out
    print(f"{'ZeRO-1 DP':<11}{'slowest rank ms':>16}{'ideal ms':>10}{'balance':>9}"
          + (f"{'Muon share @256K tok/update (EXTRAPOLATED)':>44}" if share else ""))
    for dp, z in out["zero1"].items():
        line = f"{dp:<11}{z['max_ms']:>16.1f}{z['ideal_ms']:>10.1f}{z['ideal_ms'] / z['max_ms']:>9.2f}"
        if share:
            line += f"{z['extrapolated_256k']['muon_share_of_step']:>44.1%}"
        print(line)
    if not share:
        print("(pass --slice-json from bench_slice.py for the share of the step)")
    print(f"\n{'Muon once per block (optim.muon_distributed)':<46}")
    print(f"{'DP':<4}{'NS GFLOP/rank repl':>20}{'distributed max':>17}{'min':>10}"
          f"{'NS ms/rank repl':>17}{'distributed ms':>16}{'all-gather MiB/rank':>21}")
    for dp, d in out["distributed"].items():
        print(f"{dp:<4}{d['replicated_tflop_per_rank'] * 1e3:>20.1f}{d['distributed_tflop_per_rank_max'] * 1e3:>17.1f}"
              f"{d['distributed_tflop_per_rank_min'] * 1e3:>10.1f}{d['ns_ms_replicated']:>17.1f}"
              f"{d['ns_ms_slowest_owner']:>16.1f}{d['allgather_bytes_per_rank'] / 2**20:>21.1f}")
    print("(distributed ms: the slowest owner's blocks run on this one device; the all-gather's time "
          "is not measured here, only its bytes)")
    print_gram(out["gram"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--slice", action="store_true", help="Muon at the K3 slice's shapes, with ZeRO-1 spread")
    ap.add_argument("--config", default="configs/k3_slice.yaml")
    ap.add_argument("--slice-json", help="bench_slice.py --json output (measured forward+backward per token)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="with --slice: tiny widths (CPU dry run)")
    ap.add_argument("--gram-flops", action="store_true",
                    help="slice Muon FLOPs, standard vs Gram Newton-Schulz, and the PREDICTED share (no device work)")
    args = ap.parse_args()
    if args.gram_flops:
        pred = gram_prediction(Counter((tuple(e.shape), e.heads) for e in slice_table(args)))
        print_gram(pred)
        save_json(args.json, pred)
        return
    if args.slice:
        print(f"{'shape':<22}{'heads':>6}{'count':>6}{'ms each':>10}{'TFLOP':>9}{'TFLOP/s':>9}{'ms all':>10}")
        out = slice_muon(args)
        print_slice(out)
        save_json(args.json, {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", **out})
        return
    out = {"device": torch.cuda.get_device_name()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    X = torch.randn(512, 512, 512, device="cuda", generator=gen).bfloat16() / 512
    A = X @ X.mT
    B = torch.baddbmm(A, A, A, beta=-4.775, alpha=2.0315)
    kinds = {"gram X X^T": (None, X, X.mT, 0.0, 1.0), "b A + c A A": (A, A, A, -4.775, 2.0315),
             "a X + B X": (X, B, X, 3.4445, 1.0)}
    print(f"{'one GEMM on [512, 512, 512] bf16':<36}{'torch us':>10}{'ours us':>10}{'ratio':>8}{'rel diff':>10}")
    for name, (c, a, b, beta, alpha) in kinds.items():
        def theirs():
            return torch.bmm(a, b) if c is None else torch.baddbmm(c, a, b, beta=beta, alpha=alpha)

        def ours():
            return baddbmm_triton(c, a, b, beta=beta, alpha=alpha)

        d = rel(ours(), theirs())
        t_torch, t_ours = graph_ms(theirs) * 1e3, graph_ms(ours) * 1e3
        out[name] = {"torch_us": t_torch, "ours_us": t_ours, "rel_diff": d}
        print(f"{name:<36}{t_torch:>10.1f}{t_ours:>10.1f}{t_torch / t_ours:>7.2f}x{d:>10.1e}")
    print(f"\n{'newton_schulz, 5 steps, bf16':<36}{'torch ms':>10}{'ours ms':>10}{'ratio':>8}"
          f"{'rel diff':>10}{'err torch':>10}{'err ours':>10}")
    for s, m, n in SHAPES:
        G = torch.randn(s, m, n, device="cuda", generator=gen)
        # fp32 reference: the same iteration with fp32 operands (torch's GEMMs).
        fp32 = _ns_fp32(G)
        a_t, a_o = ns_with("torch", G), ns_with("k3train", G)
        t_torch = graph_ms(lambda: ns_with("torch", G))
        t_ours = graph_ms(lambda: ns_with("k3train", G))
        row = {"torch_ms": t_torch, "ours_ms": t_ours, "rel_diff": rel(a_o, a_t),
               "err_torch": rel(a_t, fp32), "err_ours": rel(a_o, fp32)}
        out[f"ns {s}x{m}x{n}"] = row
        print(f"{f'[{s}, {m}, {n}]':<36}{t_torch:>10.2f}{t_ours:>10.2f}{t_torch / t_ours:>7.2f}x"
              f"{row['rel_diff']:>10.1e}{row['err_torch']:>10.1e}{row['err_ours']:>10.1e}")
    save_json(args.json, out)


def _ns_fp32(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The same quintic iteration in fp32 (reference for both bf16 backends)."""
    a, b, c = muon.NS_COEFFICIENTS
    X = G.float()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


if __name__ == "__main__":
    main()
