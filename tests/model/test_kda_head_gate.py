"""``model.kda.gate=head``: Gated DeltaNet's scalar decay through the KDA layer and kernels.

Reference: the gate written out from the layer's own parameters (one value per head,
``lower_bound * sigmoid(exp(A_log) * (x W_head^T + dt_bias))``) and the token-by-token delta
rule (``k3train/ops/kda/naive.py``) on the layer's q, k, v and beta; fp64 on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import k3train.model.kda_layer as kda_layer
from k3train.model.kda_layer import KimiDeltaAttention
from k3train.ops.kda.naive import naive_recurrent_kda


def test_head_gate_is_one_decay_per_head_through_the_delta_rule(world1, monkeypatch):
    torch.manual_seed(0)
    H, K, D = 3, 4, 16
    layer = KimiDeltaAttention(hidden_size=D, num_heads=H, head_dim=K, chunk_size=4, gate="head").double()
    assert not hasattr(layer, "f_down") and layer.dt_bias.shape == (H,)
    x = torch.randn(2, 9, D, dtype=torch.float64, requires_grad=True)
    seen = {}
    core = kda_layer.kda_gated

    def spy(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, **kwargs):
        seen.update(q=q, k=k, v=v, beta=beta_logits)
        o = core(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, **kwargs)
        seen["o"] = o
        return o

    monkeypatch.setattr(kda_layer, "kda_gated", spy)
    layer(x).sum().backward()
    # the gate from the layer's parameters: [B, T, H], the same for all K channels
    logit = torch.exp(layer.A_log) * (x @ layer.f_head.inner.weight.t() + layer.dt_bias)
    g = (layer.lower_bound * torch.sigmoid(logit)).unsqueeze(-1).expand(2, 9, H, K)
    # fla's in-kernel L2 norm: x / sqrt(sum(x^2) + 1e-6)
    q, k = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (seen["q"], seen["k"]))
    want, _ = naive_recurrent_kda(q, k, seen["v"], g, torch.sigmoid(seen["beta"]))
    torch.testing.assert_close(seen["o"], want, rtol=1e-10, atol=1e-12)
    for p in (layer.f_head.inner.weight, layer.dt_bias, layer.A_log):
        assert p.grad is not None and p.grad.abs().max() > 0


def test_bad_gate_and_hf_export_are_refused(world1):
    with pytest.raises(ValueError, match="gate must be 'channel' .* or 'head'"):
        KimiDeltaAttention(hidden_size=8, num_heads=2, head_dim=4, gate="token")
    from k3train.config import load_config
    from k3train.errors import UsageError
    from k3train.hf.export import export_hf

    cfg = load_config("configs/k3_tiny.yaml", ["model.kda.gate=head"])
    with pytest.raises(UsageError, match="model.kda.gate='head' .* no counterpart in the Hugging Face format"):
        export_hf({}, cfg, "/nonexistent")
