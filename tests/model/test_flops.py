"""FLOP count against a hand count, and against the parameters of the built model."""
import math

import pytest

from k3train.config import load_config
from k3train.model.flops import datasheet_peak_flops, flops_breakdown, matmul_params, mfu
from k3train.model.model import build_model

# d=8, 2 layers "KM", layer 0 dense, AttnRes blocks of 1, vocab 16, T=10.
TINY = ["model.vocab_size=16", "model.hidden_size=8", "model.num_layers=2", "model.layer_pattern=KM",
        "model.dense_layers=1", "model.kda.num_heads=2", "model.kda.head_dim=4", "model.kda.conv_size=2",
        "model.kda.chunk_size=4", "model.mla.num_heads=2", "model.mla.q_lora_rank=6",
        "model.mla.kv_lora_rank=5", "model.mla.qk_nope_head_dim=3", "model.mla.qk_rope_head_dim=1",
        "model.mla.v_head_dim=2", "model.ffn.intermediate_size=12", "moe.num_experts=4", "moe.topk=2",
        "moe.latent_size=4", "moe.expert_ffn_size=3", "moe.num_shared_experts=1", "moe.shared_ffn_size=5",
        "model.attnres.block_size=1", "train.seq_len=10"]


def test_flops_match_hand_count():
    cfg = load_config(None, TINY)
    # KDA (H=2, K=V=4, width 8): q,k,v,g 4*8*8=256, conv 3*8*2=48, forget gate 8*4+4*8=64, beta 8*2=16, o 64
    kda = 256 + 48 + 64 + 16 + 64
    # MLA (H=2): q_down 8*6=48, q_up 6*2*4=48, kv_down 8*6=48, kv_up 5*2*5=50, gate 8*4=32, o 4*8=32
    mla = 48 + 48 + 48 + 50 + 32 + 32
    dense = 3 * 8 * 12
    # MoE: router 8*4, down+up 2*8*4, 2 routed experts 2*3*4*3, shared 3*8*5
    moe = 32 + 64 + 72 + 120
    head = 8 * 16
    assert matmul_params(cfg) == {"kda": kda, "mla": mla, "dense_ffn": dense, "moe": moe, "head": head,
                                  "total": kda + mla + dense + moe + head}
    f = flops_breakdown(cfg)
    assert f["mla_attention"] == 3 * 2 * 2 * (3 + 1 + 2) * 11 / 2           # mean causal context 5.5
    assert f["kda_recurrence"] == 3 * 2 * 2 * (4 * (3 * 4 + 2 * 4) + 3 * 4 * 4)
    # AttnRes sources: layer0 mixer 1, ffn 2; layer1 mixer 2, ffn 3; final 3 -> 11
    assert f["attnres"] == 12 * 8 * 11
    assert f["total"] == pytest.approx(6 * (kda + mla + dense + moe + head) + f["mla_attention"]
                                       + f["kda_recurrence"] + f["attnres"])
    assert mfu(1000.0, cfg, peak_flops=f["total"] * 4000.0) == pytest.approx(0.25)
    assert mfu(1000.0, cfg, peak_flops=f["total"] * 1000.0, num_devices=2) == pytest.approx(0.5)


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_matmul_params_equal_the_built_model(world1, gate):
    cfg = load_config("configs/k3_tiny.yaml", [f"model.kda.gate={gate}"])
    model = build_model(cfg)
    no_matmul = ("embed.", "norm", "_res.", "A_log", "dt_bias", "o_norm_weight")
    counted = 0
    for name, p in model.named_parameters():
        if any(s in name for s in no_matmul):
            continue
        routed = ".ffn.experts." in name
        counted += p.numel() * cfg.moe.topk // cfg.moe.num_experts if routed else p.numel()
    assert matmul_params(cfg)["total"] == counted
    assert math.isfinite(flops_breakdown(load_config("configs/k3_full.yaml"))["total"])


def test_datasheet_peak_by_gpu_name():
    assert datasheet_peak_flops("NVIDIA H200") == 989e12 and datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12 and datasheet_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert datasheet_peak_flops(None) is None and datasheet_peak_flops("NVIDIA GeForce RTX 3090") is None
