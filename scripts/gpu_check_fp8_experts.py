"""FP8 routed experts on one H200: the kernel against its exact emulation, its speed, and training.

    python scripts/gpu_check_fp8_experts.py [--json OUT.json] [--steps 30] [--skip-train]
    (with $OUT set, results also go to $OUT/gpu_check_fp8_experts.json and the runs under $OUT)

1. Correctness. ``Fp8GroupedGemm()`` (torchao's rowwise-scaled grouped GEMM, groups padded to
   16 rows by ``moe.group_pad``) against ``Fp8GroupedGemm(emulate=True)`` (the same scales and
   E4M3 rounding, fp32 products, unpadded groups) on the same bf16 inputs: forward output, input
   gradient and weight gradient, as relative L2 error. Two cases: a small one with uneven,
   empty and unaligned groups (G=8, K=256, N=512), and one of the slice's gate/up GEMMs
   (4096 tokens x top-16 over 32 experts, K=3584, N=3072). Both sides quantise the same values
   with the same power-of-two scales, so they differ only by accumulation (Hopper's fast fp8
   accumulation in the kernel, fp32 in the emulation) and bf16 output rounding (2^-9).
   Inputs spread their magnitudes over rows and columns (factors 100-1000), and the worst row
   or expert is gated too, so that an error confined to a few rows or experts (a wrong group
   boundary, padding leaking in) is not averaged away. (A power-of-two scale taken over the
   wrong dimension changes results only where values go subnormal or saturate; the CPU tests
   pin the scaling axes of the emulation exactly.) Stated tolerance, for output and
   both gradients: relative L2 <= 1e-2 over the whole tensor, and <= 2e-2 for the worst row
   (output, input gradient) or expert (weight gradient); a kernel that skipped quantising
   would be ~4% off. Experts with no tokens must get exactly zero weight gradient. Also
   printed: the error of each against the bf16 product, which E4M3 rounding (relative step
   2^-4 per operand) bounds; checked <= 0.08 relative L2 (about 0.04 expected).
2. Speed at the slice's expert shapes (M = 4096 x 16 = 65536 rows over 32 experts; gate/up
   K=3584 -> N=3072, down K=3072 -> N=3584): ``torch._grouped_mm`` in bf16 against the FP8
   hook, forward and forward+backward, median of 10 after 3 warm-ups; and the whole expert
   block (``GroupedExperts``, fp32 master weights under bf16 autocast, padding included).
   Reported, not gated (PASS line states the ratio).
3. Training: ``k3train train`` on configs/k3_slice.yaml, ``--steps`` steps at 2 x 4096 tokens
   per step (``train.microbatches=2``, so the runs fit the time), under fp8 with the pre-experts
   scope (attention, latent and shared-expert linears) and fp8 with ``precision.fp8_experts=true``
   (the routed experts too); ``--bf16`` adds a bf16 run. Losses side by side and tokens/s (median
   after step 5).
   Gate: every loss finite, step-1 loss of fp8+experts within 0.05 of fp8 without experts, and
   mean |difference| over the run within 0.1 (float8 rounding and training chaos; measured
   figures are in the JSON).
Exit status 1 if any gate fails. Expected runtime about 4 minutes on one H200.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import timeit
from k3train.quant.fp8_grouped import Fp8GroupedGemm
from moe import GroupedExperts
from moe.group_pad import pad_groups

SLICE_PRE_EXPERT_SCOPE = ["\\.ffn\\.(down|up)$", "\\.ffn\\.shared$", "\\.mixer\\.(q|k|v|g|o|gate)_proj$",
                          "\\.mixer\\.(q|kv)_(down|up)$"]
RESULTS: dict = {}
FAILED: list[str] = []


def verdict(name: str, ok: bool | None, detail: str) -> None:
    """ok None: a measurement with no bound (the speed rows), printed as INFO."""
    print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def worst_slice_rel(a: torch.Tensor, b: torch.Tensor, dims: tuple[int, ...]) -> float:
    """Largest relative L2 error over the slices that keep the dims not in ``dims`` (rows of a
    2-D output, experts of a 3-D weight gradient); all-zero slices (empty experts) left out."""
    a, b = a.double(), b.double()
    den = b.norm(dim=dims)
    keep = den > 0
    return ((a - b).norm(dim=dims)[keep] / den[keep]).max().item()


def routed_counts(tokens: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert when each token picks ``topk`` distinct experts at random."""
    picks = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    return torch.bincount(picks.flatten(), minlength=experts)


def run_gemm(gemm, x, w, counts, dy):
    """(y, dx, dw) of ``gemm`` on x [M, K], w [G, K, N], padding the groups if it asks."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    align = getattr(gemm, "group_alignment", 1)
    if align > 1:
        xp, offs, rows = pad_groups(x, counts, align)
        y = gemm(xp, w, offs).index_select(0, rows)
    else:
        y = gemm(x, w, torch.cumsum(counts, 0, dtype=torch.int32))
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def check_correctness(name: str, counts: list[int] | torch.Tensor, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(1)
    counts = torch.as_tensor(counts, dtype=torch.int64)
    m, g = int(counts.sum()), counts.numel()
    # Magnitudes spread over rows and columns (a factor 100-1000): an error confined to some
    # rows or experts shows in the worst-slice figure instead of averaging away.
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, m)[:, None]).to("cuda", torch.bfloat16)
    w = (torch.randn(g, k, n, generator=gen) * 0.02 * torch.logspace(-1, 1, k)[:, None]
         * torch.logspace(1, -1, n)).to("cuda", torch.bfloat16)
    dy = (torch.randn(m, n, generator=gen) * torch.logspace(1, -2, m)[:, None]
          * torch.logspace(-1, 1, n)).to("cuda", torch.bfloat16)
    counts = counts.cuda()
    kern = run_gemm(Fp8GroupedGemm(), x, w, counts, dy)
    emul = run_gemm(Fp8GroupedGemm(emulate=True), x, w, counts, dy)
    # The bf16 product, in fp32 from the bf16 operands (the reference the rounding is measured on).
    xf, wf, dyf = x.float(), w.float(), dy.float()
    bounds = torch.cumsum(counts, 0).tolist()
    ref_y = torch.cat([xf[lo:hi] @ wf[e] for e, (lo, hi) in enumerate(zip([0, *bounds[:-1]], bounds))])
    ref_dx = torch.cat([dyf[lo:hi] @ wf[e].T for e, (lo, hi) in enumerate(zip([0, *bounds[:-1]], bounds))])
    ref_dw = torch.stack([xf[lo:hi].T @ dyf[lo:hi] for lo, hi in zip([0, *bounds[:-1]], bounds)])
    row = {}
    for part, a, b, ref, dims in zip(("y", "dx", "dw"), kern, emul, (ref_y, ref_dx, ref_dw), ((1,), (1,), (1, 2))):
        row[part] = {"kernel_vs_emulation": rel(a, b), "kernel_vs_emulation_worst_slice": worst_slice_rel(a, b, dims),
                     "kernel_vs_bf16": rel(a, ref), "emulation_vs_bf16": rel(b, ref)}
    RESULTS[f"correctness_{name}"] = row
    worst = max(v["kernel_vs_emulation"] for v in row.values())
    worst_slice = max(v["kernel_vs_emulation_worst_slice"] for v in row.values())
    verdict(f"kernel_vs_emulation_{name}", worst <= 1e-2 and worst_slice <= 2e-2,
            "rel L2 " + ", ".join(f"{p} {v['kernel_vs_emulation']:.2e}" for p, v in row.items()) + " (<= 1e-2); "
            "worst row / expert " + ", ".join(f"{p} {v['kernel_vs_emulation_worst_slice']:.2e}" for p, v in row.items())
            + " (<= 2e-2)")
    empty = (counts == 0).nonzero().flatten()
    if empty.numel():  # experts with no tokens: exactly zero weight gradient from the kernel
        dw_max = kern[2][empty].abs().max().item()
        RESULTS[f"empty_expert_dw_max_{name}"] = dw_max
        verdict(f"empty_experts_{name}", dw_max == 0, f"max |dw| of {empty.numel()} empty experts {dw_max:.1e} (== 0)")
    worst_ref = max(max(v["kernel_vs_bf16"], v["emulation_vs_bf16"]) for v in row.values())
    verdict(f"fp8_vs_bf16_{name}", worst_ref <= 0.08,
            "kernel rel L2 " + ", ".join(f"{p} {v['kernel_vs_bf16']:.2e}" for p, v in row.items()) + " (<= 0.08)")


def cuda_time(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``benchmarks.common.timeit``)."""
    return timeit(fn, warmup=warmup, iters=iters, device="cuda")


def check_speed(tokens: int = 4096, experts: int = 32, topk: int = 16, latent: int = 3584, ffn: int = 3072) -> None:
    """The slice's expert shapes by default (configs/k3_slice.yaml: moe.latent_size, expert_ffn_size)."""
    gen = torch.Generator().manual_seed(2)
    counts = routed_counts(tokens, experts, topk, gen).cuda()
    m = int(counts.sum())
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    fp8 = Fp8GroupedGemm()
    speed = {}
    for name, k, n in (("gate_up", latent, ffn), ("down", ffn, latent)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(experts, k, n, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        xp, offs_p, rows = pad_groups(x.detach(), counts, fp8.group_alignment)
        xp.requires_grad_()
        dyp = dy.new_zeros(xp.shape[0], n).index_copy(0, rows, dy)
        flops = 2 * m * k * n
        row = {
            "bf16_fwd_ms": cuda_time(lambda: torch._grouped_mm(x, w, offs=offs)),
            "fp8_fwd_ms": cuda_time(lambda: fp8(xp, w, offs_p)),
            "bf16_fwd_bwd_ms": cuda_time(lambda: torch._grouped_mm(x, w, offs=offs).backward(dy)),
            "fp8_fwd_bwd_ms": cuda_time(lambda: fp8(xp, w, offs_p).backward(dyp)),
        }
        for key in ("bf16_fwd", "fp8_fwd"):
            row[key + "_tflops"] = flops / row[key + "_ms"] / 1e9
        for key in ("bf16_fwd_bwd", "fp8_fwd_bwd"):
            row[key + "_tflops"] = 3 * flops / row[key + "_ms"] / 1e9
        row["speedup_fwd"] = row["bf16_fwd_ms"] / row["fp8_fwd_ms"]
        row["speedup_fwd_bwd"] = row["bf16_fwd_bwd_ms"] / row["fp8_fwd_bwd_ms"]
        speed[name] = row
        verdict(f"speed_{name}", None, f"fwd {row['speedup_fwd']:.2f}x ({row['fp8_fwd_tflops']:.0f} vs "
                f"{row['bf16_fwd_tflops']:.0f} TFLOP/s), fwd+bwd {row['speedup_fwd_bwd']:.2f}x "
                f"({row['fp8_fwd_bwd_tflops']:.0f} vs {row['bf16_fwd_bwd_tflops']:.0f} TFLOP/s)")
    # The whole expert block as the trainer runs it: fp32 master weights, bf16 autocast.
    torch.manual_seed(0)
    block_experts = GroupedExperts(experts, latent, ffn).cuda()
    x = torch.randn(m, latent, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, latent, device="cuda", dtype=torch.bfloat16)

    def block():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = block_experts(x, counts)
        y.backward(dy)

    block_experts.grouped_gemm = None
    bf16_ms = cuda_time(block)
    block_experts.grouped_gemm = fp8
    fp8_ms = cuda_time(block)
    speed["expert_block"] = {"bf16_fwd_bwd_ms": bf16_ms, "fp8_fwd_bwd_ms": fp8_ms, "speedup": bf16_ms / fp8_ms}
    verdict("speed_expert_block", None, f"GroupedExperts fwd+bwd {bf16_ms:.1f} ms bf16, {fp8_ms:.1f} ms fp8: "
            f"{bf16_ms / fp8_ms:.2f}x")
    RESULTS["speed"] = speed


def train(run_dir: Path, steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "k3train", "train", "--config", "configs/k3_slice.yaml", "--run-dir", str(run_dir),
           f"train.steps={steps}", f"train.eval_interval={steps}", "train.microbatches=2", "train.log_interval=1",
           "logging.wandb.mode=disabled", "logging.progress_bar=false", "checkpoint.interval=0", *overrides]
    t0 = time.monotonic()
    with open(run_dir.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=240).returncode
    if rc:
        tail = run_dir.with_suffix(".log").read_text().splitlines()[-12:]
        raise RuntimeError(f"{' '.join(cmd[2:])} failed ({rc}):\n" + "\n".join(tail))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tok = [r["tokens_per_s"] for r in recs[5:] if "tokens_per_s" in r]
    return {"losses": [r["loss"] for r in recs], "tokens_per_s": statistics.median(tok) if tok else None,
            "seconds": round(time.monotonic() - t0)}


def check_training(out: Path, steps: int, with_bf16: bool) -> None:
    scope = "precision.scope=[" + ",".join(f"'{p}'" for p in SLICE_PRE_EXPERT_SCOPE) + "]"
    runs = {"fp8_no_experts": ["precision.recipe=fp8", scope], "fp8_experts": ["precision.recipe=fp8", "precision.fp8_experts=true"]}
    if with_bf16:
        runs = {"bf16": ["precision.recipe=bf16"], **runs}
    got = {}
    for name, overrides in runs.items():
        try:
            got[name] = train(out / f"train_{name}", steps, overrides)
        except Exception as exc:  # noqa: BLE001 - report and gate, do not hide
            verdict(f"train_{name}", False, str(exc))
            RESULTS["train"] = got
            return
        print(f"  {name}: {got[name]['seconds']} s, {got[name]['tokens_per_s']} tokens/s", flush=True)
    RESULTS["train"] = got
    print("step " + " ".join(f"{n:>16}" for n in runs))
    for i in range(steps):
        print(f"{i + 1:4d} " + " ".join(f"{got[n]['losses'][i]:16.4f}" if i < len(got[n]['losses']) else " " * 16
                                         for n in runs))
    a, b = got["fp8_experts"]["losses"], got["fp8_no_experts"]["losses"]
    finite = all(math.isfinite(v) for n in runs for v in got[n]["losses"]) and len(a) == len(b) == steps
    diffs = [abs(u - v) for u, v in zip(a, b)]
    verdict("train_losses", finite and diffs[0] <= 0.05 and sum(diffs) / len(diffs) <= 0.1,
            f"step 1 |diff| {diffs[0]:.4f} (<= 0.05), mean |diff| {sum(diffs) / len(diffs):.4f} (<= 0.1), "
            f"first {a[0]:.4f}, last {a[-1]:.4f} with experts vs {b[-1]:.4f} without")
    tps = {n: got[n]["tokens_per_s"] for n in runs}
    ratio = (f"; with / without experts = {tps['fp8_experts'] / tps['fp8_no_experts']:.2f}x"
             if tps["fp8_experts"] and tps["fp8_no_experts"] else "")
    verdict("train_speed", True, ", ".join(f"{n} {v:.0f} tokens/s" for n, v in tps.items() if v) + ratio)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="also train the slice in bf16 (a third run, ~1 min)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("FAIL setup: needs a CUDA GPU with compute capability >= 8.9")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references must be fp32
    out = Path(os.environ.get("OUT") or "/tmp/gpu_check_fp8_experts")
    out.mkdir(parents=True, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name()
    check_correctness("small", [37, 0, 64, 5, 130, 16, 0, 91], 256, 512)
    check_correctness("slice_gate", routed_counts(4096, 32, 16, torch.Generator().manual_seed(3)), 3584, 3072)
    check_speed()
    torch.cuda.empty_cache()
    if not args.skip_train:
        check_training(out, args.steps, args.bf16)
    RESULTS["failed"] = FAILED
    text = json.dumps(RESULTS, indent=1)
    for path in filter(None, (args.json, os.environ.get("OUT") and str(out / "gpu_check_fp8_experts.json"))):
        Path(path).write_text(text)
    print("ALL PASS" if not FAILED else f"FAILED: {', '.join(FAILED)}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
