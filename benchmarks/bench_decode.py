"""Decode speed, eager against CUDA-graphed, side by side in one run, and whether both decode the same tokens.

    python3 -m benchmarks.bench_decode --config configs/k3_mini.yaml --batch 1,16 --tokens 256   # one H200
    python3 -m benchmarks.bench_decode --config configs/k3_mini.yaml --batch 1 --profile 64  # + where a step's GPU time goes
    python3 -m benchmarks.bench_decode --device cpu --config configs/k3_tiny.yaml --batch 1,2 --tokens 8

The model is the config's, randomly initialised (weights do not change the cost; the config's
checkpoint-free twin of what ``k3train generate`` loads), in bf16 on CUDA and fp32 on CPU, with
``kernels.compile=false`` and the local MoE dispatcher, as ``generate`` runs it. For each batch
size B, B prompts of ``--prompt-len`` minus 0-3 tokens (different lengths, as ``generate``
allows) are prefilled and then ``--tokens`` greedy tokens decoded per sequence through
``k3train.infer.decoder.Decoder``, twice:

* eager: the static-buffer decode step run op by op (``--cuda-graph false``);
* graphed: the same step captured once per batch size after 2 eager warm-up steps and replayed
  (``--cuda-graph auto`` on CUDA). The first graphed call (warm-up, capture) is untimed; the
  second is timed.

Reported per B: decode tokens/s over all B sequences (``B x (tokens - 1)`` steps' tokens over the
decode time; prefill excluded, timed apart), the graphed/eager ratio, and PASS when the graphed
greedy tokens equal the eager ones for every sequence and all ``--tokens`` (FAIL otherwise, with
the first position that differs). On CPU there is no graph: both columns are eager (the check
is then trivial); use it as a dry run of the script.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.common import save_json
from k3train.config import load_config
from k3train.infer.cache import CachedModel
from k3train.infer.decoder import Decoder
from k3train.model.model import build_model
from k3train.ops.kernels import apply as apply_kernels
from k3train.ops.triton_compile import compile_ahead
from k3train.runtime.distributed import init_distributed


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(config: str, device: str, overrides: list[str]) -> CachedModel:
    """The config's model, random init, on ``device`` (bf16 on CUDA), with cached mixers."""
    # kernels.compile=false as generate's default; an override (kernels.compile=true) wins.
    cfg = load_config(config, ["kernels.compile=false", *overrides, "parallel.tp=1", "parallel.pp=1",
                               "parallel.ep=1", "moe.dispatcher=local", f"train.device={device}"])
    apply_kernels(cfg)
    init_distributed()
    model = build_model(cfg).to(device).eval()
    if device == "cuda":
        model = model.to(torch.bfloat16)
    return CachedModel(model)


def first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
    """'row r, token t' of the first token where two decodes differ, or None."""
    for r, (x, y) in enumerate(zip(a, b)):
        for t, (i, j) in enumerate(zip(x, y)):
            if i != j:
                return f"row {r}, token {t}"
    return None if len(a) == len(b) else "batch sizes differ"


def logit_agreement(ids_a: list[list[int]], ids_b: list[list[int]], logits_a: list, logits_b: list) -> dict:
    """Two decodes of the same prompts: {"logits_rel_err": the largest |a - b| over the logits'
    largest magnitude, over the steps before any row's tokens part; "parting_margin": the eager
    top-2 logit gap at the first parted step (None if none), in the same units}. Logits are
    ``[B, vocab]`` per step (``Decoder.generate(keep_logits=...)``)."""
    a, b = torch.tensor(ids_a), torch.tensor(ids_b)
    parted = (a != b).any(0).nonzero()
    n = int(parted[0]) if len(parted) else a.shape[1]
    la, lb = torch.stack(logits_a).float(), torch.stack(logits_b).float()
    scale = la[:n + 1].abs().max().clamp_min(1e-30)
    err = float((la[:n] - lb[:n]).abs().max() / scale) if n else 0.0
    margin = None
    if n < a.shape[1]:
        top2 = la[n].topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min() / scale)
    return {"logits_rel_err": err, "parting_margin": margin, "steps_compared": n}


def run(config: str = "configs/k3_mini.yaml", batches: tuple[int, ...] = (1, 16), tokens: int = 256,
        prompt_len: int = 64, device: str | None = None, overrides: list[str] = (), profile: int = 0,
        compiled: bool = False) -> dict:
    """Eager and graphed decode of each batch size; returns {"rows": [...], ...} (module docstring)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cached = build(config, device, list(overrides))
    vocab = cached.model.head.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    eager = Decoder(cached, cuda_graph=False)
    graphed = Decoder(cached, cuda_graph=device == "cuda")
    fused = Decoder(cached, cuda_graph=device == "cuda", compile_step="inductor") if compiled else None
    if device == "cuda":
        # fla's kernels compiled at once (a fresh machine otherwise compiles them one by one),
        # then autotuned by a real short pass; none of it timed.
        compile_ahead(lambda: eager.generate([[1] * 16], 2), label="decoding")
    rows = []
    for B in batches:
        lens = [max(prompt_len - b % 4, 1) for b in range(B)]
        prompts = [torch.randint(0, min(vocab, 256), (n,), generator=gen).tolist() for n in lens]
        eager.generate(prompts, 4)  # autotuning and allocator warm-up for this batch size
        logits_e: list = []
        ids_e, t_e = eager.generate(prompts, tokens, keep_logits=logits_e if fused is not None else None)
        first, _ = graphed.generate(prompts, tokens)  # warm-up steps, capture, replays
        ids_g, t_g = graphed.generate(prompts, tokens)
        diff = first_difference(ids_e, ids_g) or first_difference(ids_e, first)
        extra = {}
        if fused is not None:
            t = time.perf_counter()
            fused.generate(prompts, tokens)  # compile (first warm-up step), capture, replays
            extra["compile_s"] = time.perf_counter() - t
            logits_c: list = []
            ids_c, t_c = fused.generate(prompts, tokens, keep_logits=logits_c)
            extra["compiled_tokens_per_s"] = t_c["decode_tokens_per_s"]
            # Inductor reorders bf16 arithmetic, so greedy tokens may part at a near-tie of the
            # top two logits. Until they part, both decode the same inputs: compare the logits
            # there (within bf16 rounding), and the eager top-2 margin where they part.
            extra["compiled_first_difference"] = first_difference(ids_e, ids_c)
            extra.update(logit_agreement(ids_e, ids_c, logits_e, logits_c))
        rows.append({**extra, "batch": B, "tokens": tokens, "prompt_lens": [min(lens), max(lens)],
                     "eager_tokens_per_s": t_e["decode_tokens_per_s"],
                     "graphed_tokens_per_s": t_g["decode_tokens_per_s"],
                     "speedup": t_g["decode_tokens_per_s"] / t_e["decode_tokens_per_s"],
                     "prefill_s": t_g["prefill_s"], "graphed": t_g["cuda_graph"],
                     "captures": graphed.graphed.captures, "tokens_equal": diff is None, "first_difference": diff})
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if profile and device == "cuda":
        rows.append({"profile": profile_steps(graphed, prompts[:1], profile)})
        if fused is not None:
            rows.append({"profile_compiled": profile_steps(fused, prompts[:1], profile)})
    return {"device": name, "config": config, "dtype": "bf16" if device == "cuda" else "fp32",
            "weights": "random init", "rows": rows}


def profile_steps(decoder: Decoder, prompts: list[list[int]], steps: int, top: int = 25) -> dict:
    """Where a replayed decode step's GPU time goes: ``steps`` graphed tokens of ``prompts``
    under torch.profiler -> {"gpu_ms_per_step", "kernels_per_step", "wall_ms_per_step", "top":
    [{"name", "ms_per_step", "calls_per_step"}]} (kernel names truncated to 90 characters)."""
    from torch.profiler import ProfilerActivity, profile

    decoder.generate(prompts, steps)   # the graph for this batch size exists before profiling
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decoder.generate(prompts, steps)
    wall = time.perf_counter() - t0
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name[:90], []).append(e.device_time_total / 1e3)
    total = sum(sum(v) for v in kernels.values())
    n = max(steps - 1, 1)
    top_rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"gpu_ms_per_step": total / n, "kernels_per_step": sum(len(v) for v in kernels.values()) / n,
            "wall_ms_per_step": wall * 1e3 / n,
            "top": [{"name": k, "ms_per_step": sum(v) / n, "calls_per_step": len(v) / n} for k, v in top_rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    ap.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default 1,16)")
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens per sequence (default 256)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the result here too")
    ap.add_argument("--compile", action="store_true",
                    help="a third column: the graphed step with its model call compiled (torch.compile, inductor)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS graphed steps of one sequence: GPU time per step and its top kernels")
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(args.config, tuple(int(b) for b in args.batch.split(",")), args.tokens, args.prompt_len,
              args.device, args.overrides, args.profile, args.compile)
    print(f"{res['device']} {args.config} {res['dtype']}, {res['weights']}: {args.tokens} greedy tokens "
          f"per sequence, prompts of {args.prompt_len} - (0..3) tokens")
    print(f"{'batch':>5} {'eager tok/s':>12} {'graphed tok/s':>14} {'speedup':>8}  graphed tokens == eager")
    profiles = {k: r[k] for r in res["rows"] for k in ("profile", "profile_compiled") if k in r}
    res["rows"] = [r for r in res["rows"] if not set(r) & {"profile", "profile_compiled"}]
    res.update(profiles)
    for r in res["rows"]:
        check = "PASS" if r["tokens_equal"] else f"FAIL (first at {r['first_difference']})"
        graphed = f"{r['graphed_tokens_per_s']:>14.1f}" if r["graphed"] else f"{'(no graph)':>14}"
        print(f"{r['batch']:>5} {r['eager_tokens_per_s']:>12.1f} {graphed} {r['speedup']:>7.2f}x  {check}")
        if "compiled_tokens_per_s" in r:
            print(f"      graphed + compiled step: {r['compiled_tokens_per_s']:.1f} tok/s "
                  f"({r['compiled_tokens_per_s'] / r['graphed_tokens_per_s']:.3f}x graphed; compile and capture "
                  f"{r['compile_s']:.0f} s); tokens == eager: "
                  f"{'all' if r['compiled_first_difference'] is None else 'to ' + r['compiled_first_difference']}; "
                  f"logits vs eager over the {r['steps_compared']} steps before that: max rel. error "
                  f"{r['logits_rel_err']:.2e}" + ("" if r["parting_margin"] is None else
                  f"; eager top-2 margin where they part {r['parting_margin']:.2e}"))
    for name, p in profiles.items():
        print(f"{name}, batch 1: {p['gpu_ms_per_step']:.3f} ms of GPU kernels per step ({p['kernels_per_step']:.0f} "
              f"kernels), {p['wall_ms_per_step']:.3f} ms wall per step under the profiler")
        for t in p["top"]:
            print(f"  {t['ms_per_step']:8.4f} ms  {t['calls_per_step']:6.1f}x  {t['name']}")
    print(f"(tokens/s: all sequences of the batch together, decode only; {time.perf_counter() - t0:.0f} s in all)")
    save_json(args.json, res)
    return 0 if all(r["tokens_equal"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
