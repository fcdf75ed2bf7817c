"""Does the compiled decode step compute what the eager one does? Teacher-forced, per step, with MoE routing flips counted.

``bench_decode --compile`` lets both decodes run free: once a greedy token parts, the two see
different inputs and every later logit differs. Here every decoder is fed the same tokens (the
eager fp32 greedy ones), so step t's logits of two decoders differ only by what their step t
computes from the same history. Per dtype (fp32, then bf16, the config's model at one seed,
random init), per decode step:

* ``eager_vs_fp32``: eager step in this dtype against the eager fp32 step (the dtype's own
  rounding: the yardstick for bf16);
* ``compiled``: ``Decoder(compile_step=BACKEND)``, not graphed, against the eager step;
* ``compiled_graphed``: the same compiled step captured in a CUDA graph and replayed (what
  ``bench_decode --compile`` and ``generate --compile`` run), against the eager step;
* ``flips``: MoE layers whose top-k expert set differs between the compiled and the eager step
  (read from each layer's routing record after the ungraphed steps).

Errors are max |a - b| over the eager logits' largest magnitude of that step. Why the flips: a
random-init router's sigmoid scores sit within a bf16 ulp of each other, so a rounding
difference (inductor fuses and keeps fp32 intermediates where eager rounds to bf16) picks
another expert; one flip moves that layer's output by a whole expert's share, which the KDA
state and the latent cache then carry into later steps. The CPU measurement that found this
is in tests/infer/test_compiled_decode.py.

Gate (exit 0): in fp32 every step of both compiled decoders before the first routing flip (all
steps if none; at least one) is within ``--fp32-tol`` (1e-3, TF32 off) of the eager step. A dropped or misplaced state update (KDA state, conv tails, latent
slot, position) would show there as errors of order 1e-1. bf16 is reported, not gated.

    python scripts/gpu_check_compiled_decode.py --config configs/k3_mini.yaml --steps 16 [--json OUT]
    python scripts/gpu_check_compiled_decode.py --device cpu --config configs/k3_tiny.yaml --backend aot_eager --steps 4  # dry run
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import save_json
from k3train.config import load_config
from k3train.infer.cache import CachedModel
from k3train.infer.decoder import Decoder
from k3train.model.model import build_model
from k3train.ops.kernels import apply as apply_kernels
from k3train.ops.triton_compile import compile_ahead
from k3train.runtime.distributed import init_distributed
from moe import LatentMoE


def build(config: str, device: str, dtype: torch.dtype, overrides: list[str]) -> CachedModel:
    """The config's model, random init at seed 0 (the same weights for every dtype), cached mixers."""
    cfg = load_config(config, ["kernels.compile=false", *overrides, "parallel.tp=1", "parallel.pp=1",
                               "parallel.ep=1", "moe.dispatcher=local", f"train.device={device}"])
    apply_kernels(cfg)
    init_distributed()
    torch.manual_seed(0)
    return CachedModel(build_model(cfg).to(device).to(dtype).eval())


def routes(cached: CachedModel) -> list:
    """Per MoE layer, its last step's expert sets (sorted indices per token)."""
    return [layer.ffn.routing.last.indices.sort(-1).values.tolist()
            for layer in cached.model.layers if isinstance(layer.ffn, LatentMoE)]


@torch.no_grad()
def forced(dec: Decoder, prompts: list[list[int]], tokens: torch.Tensor, record_routes: bool = False):
    """Prefill, then one step per column of ``tokens`` [B, n] fed as the step's input (through
    the decoder's graph wrapper, as ``generate`` runs it) -> (logits [n + 1, B, vocab] fp64 on
    the CPU: prefill's then each step's, routing per step or None)."""
    n = tokens.shape[1]
    buf = dec.prefill(prompts, max(len(p) for p in prompts) + n + 1)
    out, rts = [buf.logits.double().cpu().clone()], []
    key = (buf.batch, buf.max_len, 0.0, 1.0)
    for i in range(n):
        buf.token.copy_(tokens[:, i].to(buf.token.device))
        dec.graphed.run(key, lambda: dec._step(buf, 0.0, 1.0))
        out.append(buf.logits.double().cpu().clone())
        if record_routes:
            rts.append(routes(dec.cached))
    return torch.stack(out), (rts if record_routes else None)


def rel_per_step(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """max |a - b| / max |b| per step (dim 0)."""
    return [float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(a, b)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--device", default="cuda", help="cpu dry-runs the script (no graphs)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the step")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--fp32-tol", type=float, default=1e-3)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = ap.parse_args()
    dev, graphs = args.device, args.device == "cuda"
    if graphs:  # fp32 GEMMs in fp32 on both sides: the fp32 gate measures arithmetic, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist()]
    res: dict = {"device": torch.cuda.get_device_name() if graphs else "cpu", "config": args.config,
                 "backend": args.backend, "steps": args.steps}
    ref32 = tokens = None
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch._dynamo.reset()
        cached = build(args.config, dev, dtype, args.overrides)
        eager = Decoder(cached, cuda_graph=False)
        if graphs:  # fla's kernels compiled at once, as bench_decode does (untimed here too)
            compile_ahead(lambda: eager.generate([[1] * 16], 2), label="decoding")
        if tokens is None:  # the eager fp32 greedy tokens: every decoder below is fed these
            ids, _ = eager.generate(prompts, args.steps + 1)
            tokens = torch.tensor(ids)[:, :args.steps]
        le, re_ = forced(eager, prompts, tokens, record_routes=True)
        lc, rc = forced(Decoder(cached, cuda_graph=False, compile_step=args.backend), prompts, tokens, True)
        lg, _ = forced(Decoder(cached, cuda_graph=graphs, compile_step=args.backend), prompts, tokens)
        row = {"compiled": rel_per_step(lc, le), "compiled_graphed": rel_per_step(lg, le),
               "flips": [sum(a != b for a, b in zip(x, y)) for x, y in zip(re_, rc)]}
        if ref32 is None:
            ref32 = le
        else:
            row["eager_vs_fp32"] = rel_per_step(le, ref32)
        res[name] = row
        del cached, eager
    # Gated: the fp32 steps before the first routing flip (a flip is a near-tie of router scores
    # decided by rounding, not a wrong computation; in fp32 it is rare but possible).
    r32 = res["fp32"]
    flipped = [t for t, f in enumerate(r32["flips"], start=1) if f]
    upto = flipped[0] if flipped else args.steps + 1
    worst = max(max(r32["compiled"][:upto]), max(r32["compiled_graphed"][:upto]))
    res["fp32_steps_gated"], res["fp32_worst"] = upto, worst
    res["ok"] = worst <= args.fp32_tol and upto > 1
    for name in ("fp32", "bf16"):
        r = res[name]
        print(f"{name}: step  compiled  compiled+graphed  routing flips" + ("  eager vs fp32" if "eager_vs_fp32" in r else ""))
        for t in range(args.steps + 1):
            flips = "prefill" if t == 0 else r["flips"][t - 1]
            extra = f"  {r['eager_vs_fp32'][t]:.2e}" if "eager_vs_fp32" in r else ""
            print(f"  {t:4d}  {r['compiled'][t]:.2e}  {r['compiled_graphed'][t]:.2e}  {flips}{extra}")
    print(f"{'PASS' if res['ok'] else 'FAIL'}: fp32 compiled vs eager worst {worst:.2e} over prefill and the "
          f"{upto - 1} steps before any routing flip (gate {args.fp32_tol:.0e}, at least 1 step)")
    save_json(args.json, res)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
