"""``k3train model-info`` loads every shipped config (k3_slice and k3_full at K3's real widths
included) and its counts agree with the closed-form parameter counts of ``k3train.model.flops``."""
import re
from pathlib import Path

import pytest

from k3train import cli
from k3train.config import load_config
from k3train.runtime.distributed import init_distributed, shutdown_distributed
from k3train.model.info import model_info
from k3train.model.flops import matmul_params
from k3train.config.layer_pattern import expand_layer_pattern

# k3_full builds 93 layers of 896 experts on the meta device: ~20 s here.
CONFIGS = [pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem == "k3_full" else [])
           for p in sorted(Path("configs").glob("*.yaml"))]


def _printed_counts(text: str) -> dict[str, int]:
    return {m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"^(\w+)\s+([\d,]+)\s+\(", text, re.M)}


@pytest.mark.parametrize("path", CONFIGS)
def test_model_info_of_every_shipped_config(path, capsys):
    assert cli.main(["model-info", "--config", str(path)]) == 0
    counts = _printed_counts(capsys.readouterr().out)
    cfg = load_config(path)
    m, e = cfg.model, cfg.moe
    moe_layers = len(expand_layer_pattern(m.layer_pattern, m.num_layers)) - m.dense_layers
    # Routed experts, exactly: gate, up and down of latent x expert_ffn per expert per MoE layer.
    assert counts["routed_experts"] == moe_layers * e.num_experts * 3 * e.latent_size * e.expert_ffn_size
    # Activated matmul weights against the closed form used for FLOPs (which leaves out norms,
    # convs, gate biases and the input embedding, a lookup): within 0.5%.
    built = counts["activated"] - counts["embedding"] - counts["norms"] - counts["attnres"]
    assert built == pytest.approx(matmul_params(cfg)["total"], rel=5e-3)
    assert counts["total"] == sum(counts[k] for k in ("embedding", "head", "kda", "mla", "attnres", "norms",
                                                      "dense_ffn", "router", "latent_proj", "routed_experts",
                                                      "shared_experts"))


def test_k3_slice_has_k3_widths_and_fits_one_gpu():
    """The slice keeps K3's released widths (configs/k3_full.yaml) with 2-4 layers, no dense
    layer, 32-112 routed experts, and weights + grads + Muon momentum (fp32, 12 bytes per
    parameter) under 100 GB of an H200's 141 GB, leaving room for activations."""
    s, full = load_config("configs/k3_slice.yaml"), load_config("configs/k3_full.yaml")
    assert s.model.hidden_size == full.model.hidden_size == 7168
    assert s.model.kda == full.model.kda and s.model.mla == full.model.mla
    for key in ("latent_size", "expert_ffn_size", "num_shared_experts", "shared_ffn_size", "topk"):
        assert getattr(s.moe, key) == getattr(full.moe, key), key
    kinds = expand_layer_pattern(s.model.layer_pattern, s.model.num_layers)
    assert 2 <= len(kinds) <= 4 and {"K", "M"} <= set(kinds) and s.model.dense_layers == 0
    assert 32 <= s.moe.num_experts <= 112 and full.moe.num_experts % s.moe.num_experts == 0
    assert s.model.vocab_size == 320
    init_distributed()
    try:
        total = model_info(s)[0]["total"]
    finally:
        shutdown_distributed()
    assert 12 * total < 100e9
    assert s.train.micro_batch_size * s.train.microbatches * s.train.seq_len >= 64 * 1024
