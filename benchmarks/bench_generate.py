"""Decode speed with the inference cache against re-running the full forward, and cache bytes per token.

    python3 -m benchmarks.bench_generate --json runs/bench_generate.json                      # one H200: k3_mini, bf16
    python3 -m benchmarks.bench_generate --dtype fp32 --json runs/g_dense.json model.dense_layers=16
                                                       # one H200: the correctness figure (below)
    python3 -m benchmarks.bench_generate --device cpu --config configs/k3_tiny.yaml --json /tmp/g.json

Both paths start from the same randomly initialised model (weights do not change the cost) and
the same prompt of ``--prompt-len`` tokens, then make ``--new-tokens`` greedy tokens:

* cached: one prefill, then one ``CachedModel`` step per token (KDA state update through fla's
  ``fused_recurrent_kda`` on CUDA, the naive recurrence on CPU; absorbed MLA decode against the
  latent cache);
* uncached: the whole sequence through the model again for every token (what a sampler
  without a cache does).

The correctness figure is the cache's logits against the full forward's on the same tokens at
every position (the uncached tokens fed back through the cache), relative to the largest logit;
the number of greedy tokens on which both paths agree is reported too. On CPU in fp32 the two
agree to about 1e-5. On CUDA read it on the dense twin (``model.dense_layers=<num_layers>``)
and ``--dtype fp32``: at random init the router's scores are nearly tied, so the last-bit
differences between fla's chunked kernel (tf32 dots, in the full forward) and the recurrence
(in decode) flip experts and the MoE model's logits diverge by their own size. Any change of
rounding can do that: on CPU a bf16 copy of k3_tiny differs from its fp32 self as much.

Reported: decode tokens/s of each and their ratio, and the cache's bytes per token (MLA latent vs a full per-head KV cache of
the same layers, bf16) plus the KDA layers' constant state, and the bytes the cache held at the end.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k3train.config import load_config
from k3train.runtime.distributed import init_distributed
from k3train.infer.cache import CachedModel, cache_bytes_per_token
from k3train.ops.kernels import apply as apply_kernels
from k3train.model.model import build_model
from k3train.ops.triton_compile import compile_ahead


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def _uncached(model, prompt, n, device):
    ids = prompt.clone()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    _sync(device)
    return ids[:, prompt.shape[1]:], time.perf_counter() - t0


@torch.no_grad()
def _cached(cached, prompt, n, device, force=None, keep=None):
    """Greedy decoding through the cache; ``force`` ``[1, n]``: feed these tokens instead of
    the argmax (teacher forcing); ``keep``: a list that receives each step's logits ``[1, V]``."""
    cached.reset()
    _sync(device)
    t0 = time.perf_counter()
    logits = cached(prompt)[:, -1]
    _sync(device)
    t1 = time.perf_counter()
    out = []
    for i in range(n):
        if keep is not None:
            keep.append(logits.float())
        nxt = logits.argmax(-1, keepdim=True) if force is None else force[:, i:i + 1]
        out.append(nxt)
        if i + 1 < n:
            logits = cached(nxt)[:, -1]
    _sync(device)
    return torch.cat(out, 1), t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                    help="weights and activations (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--json", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    dev = args.device
    cfg = load_config(args.config, [*args.overrides, "parallel.tp=1", "parallel.pp=1", "parallel.ep=1",
                                    "moe.dispatcher=local", f"train.device={dev}",
                                    # as k3train generate runs: no per-length recompiles (infer/generate.py)
                                    "kernels.compile=false"])
    apply_kernels(cfg)
    init_distributed()
    model = build_model(cfg).to(dev).eval()
    dtype = args.dtype or ("bf16" if dev == "cuda" else "fp32")
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(cfg.model.vocab_size, 256), (1, args.prompt_len), generator=gen).to(dev)
    # Uncached first: CachedModel swaps the model's mixers for their cached twins in place.
    # Warm-ups outside the timing: every Triton kernel compiled at once first (on a fresh machine
    # fla's kernels otherwise compile one by one, for minutes), then autotuned by a real run.
    compile_ahead(lambda: _uncached(model, prompt[:, :8], 2, dev), label="the full forward")
    _uncached(model, prompt[:, :8], 2, dev)
    ref, full_s = _uncached(model, prompt, args.new_tokens, dev)
    with torch.no_grad():  # the full forward's logits at every decode position of prompt + ref
        full_logits = model(torch.cat([prompt, ref[:, :-1]], 1))[:, args.prompt_len - 1:].float()
    cached = CachedModel(model)
    compile_ahead(lambda: _cached(cached, prompt[:, :8], 4, dev), label="cached decoding")
    _cached(cached, prompt[:, :8], 4, dev)
    got, prefill_s, decode_s = _cached(cached, prompt, args.new_tokens, dev)
    held = cached.cache_bytes()
    # The correctness figure: the cache's logits against the full forward's on the same tokens
    # (ref fed back), relative to the logits' scale. Argmax agreement alone says little at random
    # init, where the logits are nearly flat and bf16 rounding flips the greedy choice.
    kept: list[torch.Tensor] = []
    _cached(cached, prompt, args.new_tokens, dev, force=ref, keep=kept)
    step_logits = torch.cat(kept, 0)                                   # [n, V]
    diff = (step_logits - full_logits[0]).abs().amax(-1)                # [n]
    rel = (diff / full_logits[0].abs().amax(-1).clamp_min(1e-12)).max().item()
    agree = int((got == ref).int().cumprod(1).sum())
    steps = args.new_tokens - 1
    sizes = cache_bytes_per_token(model)
    res = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "config": args.config,
        "dtype": dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "prefill_s": prefill_s, "cached_decode_tokens_per_s": steps / decode_s,
        "uncached_tokens_per_s": args.new_tokens / full_s,
        "speedup": (steps / decode_s) / (args.new_tokens / full_s),
        "tokens_agreeing": agree, "logits_max_rel_diff": rel, **sizes,
        "mla_latent_vs_full_kv": sizes["mla_latent_bytes_per_token"] / max(sizes["mla_full_kv_bytes_per_token"], 1),
        "cache_bytes_held_at_end": held,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(f"{res['device']} {args.config} {res['dtype']}: prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print(f"{'path':<10} {'tok/s':>10}")
    print(f"{'cached':<10} {res['cached_decode_tokens_per_s']:>10.1f}")
    print(f"{'uncached':<10} {res['uncached_tokens_per_s']:>10.1f}")
    print(f"speedup cached/uncached {res['speedup']:.1f}x; tokens agreeing {agree}/{args.new_tokens}")
    print(f"cached vs full-forward logits on the same tokens, every position: max |diff| / max |logit| = {rel:.2e}")
    print(f"MLA cache per token: latent {sizes['mla_latent_bytes_per_token']} B vs full KV "
          f"{sizes['mla_full_kv_bytes_per_token']} B ({res['mla_latent_vs_full_kv']:.3f}x); "
          f"KDA state {sizes['kda_state_bytes']:,} B (constant); held at end {held:,} B")


if __name__ == "__main__":
    main()
