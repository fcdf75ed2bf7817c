"""Live check of ``export-hf`` against a real consumer: flash-linear-attention's
``fla.models.KDAForCausalLM`` (needs CUDA: fla's KDA kernels are Triton).

A pure-KDA model (no MLA, no MoE, no AttnRes) is the part of K3 whose architecture fla's KDA
model shares. Two of our choices still differ from it, and this script picks the config where
they coincide, so the comparison is exact in real arithmetic:
* output gate: ours is full rank ``d -> H*K``, fla's is rank ``K`` (``g_proj.0``, ``g_proj.1``).
  With one KDA head (H*K = K) ours is fla's with ``g_proj.1 = I`` and zero bias;
* per-head output-norm weight ``[H, K]`` vs fla's shared ``[K]``: equal with one head;
* SiTU-GLU vs SwiGLU: SiTU tends to SiLU and the soft cap to the identity as
  ``situ_beta``/``situ_beta_lin`` grow; at 1e4 the difference is below fp32 rounding here.
The exported directory is read with safetensors and renamed to fla's module names (the table
in docs/hf_format.md); fla loads it with ``strict=True``, so an unmapped tensor fails.

    python scripts/check_hf_fla.py --json /tmp/hf_fla.json

Prints max |logit difference| relative to max |logit| in fp32 and in bf16, and passes when the
fp32 one is < 1e-3 and the bf16 one < 3e-2.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k3train.config import load_config  # noqa: E402
from k3train.runtime.distributed import init_distributed  # noqa: E402
from k3train.hf.export import export_hf  # noqa: E402
from k3train.hf.load import read_tensors  # noqa: E402
from k3train.model.model import build_model  # noqa: E402

OVERRIDES = ["model.vocab_size=320", "model.hidden_size=256", "model.num_layers=2", "model.layer_pattern=K",
             "model.dense_layers=2", "model.attnres.enabled=false", "model.kda.num_heads=1",
             "model.kda.head_dim=128", "model.kda.chunk_size=64", "model.ffn.intermediate_size=512",
             "model.ffn.situ_beta=1e4", "model.ffn.situ_beta_lin=1e4", "train.device=cuda"]


def to_fla(hf: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our HF names (Kimi Linear style) -> fla KDAForCausalLM names, for a one-head pure-KDA model."""
    out = {"model.embeddings.weight": hf["model.embed_tokens.weight"], "model.norm.weight": hf["model.norm.weight"],
           "lm_head.weight": hf["lm_head.weight"]}
    for i in range(num_layers):
        s, f = f"model.layers.{i}.self_attn.", f"model.layers.{i}.attn."
        out[f"model.layers.{i}.attn_norm.weight"] = hf[f"model.layers.{i}.input_layernorm.weight"]
        out[f"model.layers.{i}.mlp_norm.weight"] = hf[f"model.layers.{i}.post_attention_layernorm.weight"]
        for p in ("gate_proj", "up_proj", "down_proj"):
            out[f"model.layers.{i}.mlp.{p}.weight"] = hf[f"model.layers.{i}.mlp.{p}.weight"]
        for p in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "q_conv1d", "k_conv1d", "v_conv1d"):
            out[f + p + ".weight"] = hf[s + p + ".weight"]
        out[f + "A_log"], out[f + "dt_bias"] = hf[s + "A_log"], hf[s + "dt_bias"]
        out[f + "f_proj.0.weight"], out[f + "f_proj.1.weight"] = hf[s + "f_a_proj.weight"], hf[s + "f_b_proj.weight"]
        g = hf[s + "g_proj.weight"]  # [K, d] at one head
        out[f + "g_proj.0.weight"] = g
        out[f + "g_proj.1.weight"] = torch.eye(g.shape[0], dtype=g.dtype)
        out[f + "g_proj.1.bias"] = torch.zeros(g.shape[0], dtype=g.dtype)
        out[f + "o_norm.weight"] = hf[s + "o_norm.weight"].reshape(-1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--seq", type=int, default=300, help="tokens per sequence (crosses KDA chunks)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("check_hf_fla: needs a CUDA GPU (fla's KDA kernels are Triton)")
        return 2
    from fla.models import KDAConfig, KDAForCausalLM

    t0 = time.time()
    cfg = load_config("configs/k3_tiny.yaml", OVERRIDES)
    init_distributed(device="cuda")
    torch.manual_seed(0)
    ours = build_model(cfg)
    with torch.no_grad():  # trained-looking weights: away from init symmetries (A_log = 0 ...)
        for name, t in ours.state_dict().items():
            if isinstance(t, torch.Tensor) and t.is_floating_point() and "norm" not in name:
                t.add_(torch.randn_like(t) * (0.3 if t.dim() < 2 else 0.02))
    m = cfg.model
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(ours.state_dict(), cfg, Path(tmp) / "hf", log=lambda *_: None)
        hf = read_tensors(Path(tmp) / "hf")
    fla_cfg = KDAConfig(hidden_size=m.hidden_size, num_heads=m.kda.num_heads, head_dim=m.kda.head_dim,
                        expand_v=1.0, conv_size=m.kda.conv_size, safe_gate=True,
                        lower_bound=m.kda.gate_lower_bound, num_hidden_layers=m.num_layers,
                        intermediate_size=m.ffn.intermediate_size, hidden_act="swish", norm_eps=m.norm_eps,
                        vocab_size=m.vocab_size, tie_word_embeddings=False, fuse_norm=False, fuse_swiglu=False,
                        fuse_cross_entropy=False, use_cache=False)
    fla = KDAForCausalLM(fla_cfg)
    result = fla.load_state_dict(to_fla(hf, m.num_layers), strict=True)
    dev = torch.device("cuda")
    ours, fla = ours.to(dev).eval(), fla.to(dev).eval()
    tokens = torch.randint(0, 257, (2, args.seq), device=dev)
    rows = {}
    with torch.no_grad():
        ref32 = ours(tokens).float()
        got32 = fla(input_ids=tokens).logits.float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref16 = ours(tokens).float()
        fla16 = fla.to(torch.bfloat16)
        got16 = fla16(input_ids=tokens).logits.float()
    scale = ref32.abs().max().item()
    rows["fp32"] = (got32 - ref32).abs().max().item() / scale
    rows["bf16"] = (got16 - ref16).abs().max().item() / scale
    rows["bf16_ours_vs_fp32_ours"] = (ref16 - ref32).abs().max().item() / scale
    ok = rows["fp32"] < 1e-3 and rows["bf16"] < 3e-2
    report = {"fla_missing": list(result.missing_keys), "fla_unexpected": list(result.unexpected_keys),
              "max_rel_diff": rows, "logit_scale": scale, "passed": ok, "seconds": time.time() - t0,
              "config": OVERRIDES}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"{'precision':<24} {'max|fla-ours|/max|ours|':>24}")
    for k, v in rows.items():
        print(f"{k:<24} {v:>24.2e}")
    print(f"fla KDAForCausalLM loaded strict=True; {'PASS' if ok else 'FAIL'} (fp32 < 1e-3, bf16 < 3e-2); "
          f"{report['seconds']:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
