"""The inference cache's KDA calls on the GPU against the token-by-token recurrence.

A prefill of ``--prefill`` tokens continued from a random state, then ``--steps`` single
tokens, at K3's gate bound (log-decay down to -5 per token), fp32 inputs. Reference: the naive
recurrence (``ops/kda/naive.py``) on the CPU in fp64. Reported, each as relative L2 error of
the outputs and of the final state:

* ``prefill_gated``: ``kda_gated_state`` (what ``CachedKDA`` runs for T > 1: fla's chunked
  kernel with its in-kernel safe gate on CUDA);
* ``prefill_ungated``: ``kda`` with the log-decay computed first (fla's chunked kernel without
  the safe gate), the call the cache made before; reported, not gated on;
* ``steps``: ``fused_recurrent_kda`` one token at a time (what ``CachedKDA`` runs for T = 1).

Gate: ``prefill_gated`` and ``steps`` below 1e-2 (fla's dots may run in tf32).

    python scripts/gpu_check_kda_cache.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from k3train.infer.cache import _recurrent_kda
from k3train.ops.kda import kda, kda_gated_state
from k3train.ops.kda.naive import naive_recurrent_kda


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu only dry-runs the script (torch forms)")
    ap.add_argument("--prefill", type=int, default=200)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, T, n = args.device, args.prefill, args.steps
    B, H, K, lb = 2, 4, 64, -5.0
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v, f = r(B, T + n, H, K), r(B, T + n, H, K), r(B, T + n, H, K), r(B, T + n, H, K) * 2
    b, A_log, dt_bias, h0 = r(B, T + n, H), r(H) * 0.5, r(H, K) * 0.5, r(B, H, K, K) * 0.1

    # The independent reference: fp64, token by token, from the gate formula written out here.
    d = torch.float64
    g = lb * torch.sigmoid(torch.exp(A_log.to(d))[:, None] * (f.to(d) + dt_bias.to(d)))
    qn, kn = F.normalize(q.to(d), dim=-1), F.normalize(k.to(d), dim=-1)
    ref_o, ref_h = naive_recurrent_kda(qn[:, :T], kn[:, :T], v[:, :T].to(d), g[:, :T], torch.sigmoid(b[:, :T].to(d)),
                                       initial_state=h0.to(d), output_final_state=True)
    ref_steps = naive_recurrent_kda(qn, kn, v.to(d), g, torch.sigmoid(b.to(d)), initial_state=h0.to(d))[0][:, T:]

    to = lambda t: t.to(dev)  # noqa: E731
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "prefill": T, "steps": n}
    o, h = kda_gated_state(to(q[:, :T]), to(k[:, :T]), to(v[:, :T]), to(f[:, :T]), to(b[:, :T]), to(A_log),
                           to(dt_bias), lb, initial_state=to(h0), output_final_state=True)
    out["prefill_gated_o"], out["prefill_gated_state"] = rel(o, ref_o), rel(h, ref_h)
    o2, h2 = kda(to(qn[:, :T].float()), to(kn[:, :T].float()), to(v[:, :T]), to(g[:, :T].float()),
                 to(torch.sigmoid(b[:, :T])), initial_state=to(h0), output_final_state=True)
    out["prefill_ungated_o"], out["prefill_ungated_state"] = rel(o2, ref_o), rel(h2, ref_h)
    state, outs = to(ref_h.float()), []
    for t in range(T, T + n):
        sl = slice(t, t + 1)
        o3, state = _recurrent_kda(to(qn[:, sl].float()), to(kn[:, sl].float()), to(v[:, sl]), to(g[:, sl].float()),
                                   to(torch.sigmoid(b[:, sl])), state)
        outs.append(o3)
    out["steps_o"] = rel(torch.cat(outs, 1), ref_steps)
    out["ok"] = max(out["prefill_gated_o"], out["prefill_gated_state"], out["steps_o"]) < 1e-2
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
