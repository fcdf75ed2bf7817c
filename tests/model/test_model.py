"""Model pieces against independent, written-out references (fp64, tight tolerances)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from k3train.model.attnres import DepthAttention
from k3train.model.ffn import SiTUGLU
from k3train.model.kda_layer import KimiDeltaAttention
from k3train.model.layer import K3Layer
from k3train.model.mla import GatedMLA
from k3train.model.model import K3Chunk, build_model, produced_blocks
from pipeline.stage_io import StageIO
from tests.helpers import tiny_cfg

TIGHT = dict(rtol=1e-10, atol=1e-10)


def _reference_kda_layer(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token KDA layer written from the formulas, sharing only the weights."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    W = layer.q_conv.shape[1]

    def short_conv(lin, weight):
        y = torch.zeros_like(lin)
        for t in range(T):
            for i in range(W):
                src = t - (W - 1) + i
                if src >= 0:
                    y[:, t] += weight[:, i] * lin[:, src]
        return F.silu(y).view(B, T, H, K)

    q = short_conv(x @ layer.q_proj.weight.T, layer.q_conv)
    k = short_conv(x @ layer.k_proj.weight.T, layer.k_conv)
    v = short_conv(x @ layer.v_proj.weight.T, layer.v_conv)
    # fla's in-kernel L2 norm: the epsilon (1e-6) inside the square root
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    f = (x @ layer.f_down.weight.T @ layer.f_up.weight.T).view(B, T, H, K)
    g = layer.lower_bound * torch.sigmoid(torch.exp(layer.A_log)[:, None] * (f + layer.dt_bias))
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    out = torch.zeros(B, T, H, K, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, K, dtype=x.dtype)
            for t in range(T):
                kt = k[b, t, h][:, None]
                decayed = torch.diag(torch.exp(g[b, t, h])) @ S
                S = (torch.eye(K, dtype=x.dtype) - beta[b, t, h] * kt @ kt.T) @ decayed \
                    + beta[b, t, h] * kt @ v[b, t, h][None, :]
                out[b, t, h] = S.T @ (q[b, t, h] * K ** -0.5)
    rms = torch.sqrt(out.pow(2).mean(-1, keepdim=True) + layer.eps)
    out = out / rms * layer.o_norm_weight
    out = out * torch.sigmoid(x @ layer.g_proj.weight.T).view(B, T, H, K)
    return out.reshape(B, T, H * K) @ layer.o_proj.weight.T


def test_kda_layer_matches_token_loop(world1):
    layer = KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=8, conv_size=4, std=0.3).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _reference_kda_layer(layer, x), **TIGHT)


def test_kda_layer_gradients_match_token_loop(world1):
    # Backward through the conv taps, the in-kernel gate and norm, against autograd on the loop.
    layer = KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=8, conv_size=4, std=0.3).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 7, 16, dtype=torch.float64)
    params = [x, *layer.parameters()]
    got = torch.autograd.grad(layer(x), params, dy)
    ref = torch.autograd.grad(_reference_kda_layer(layer, x), params, dy)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_attnres_embedding_joins_the_blocks_in_the_autocast_dtype(world1):
    cfg = tiny_cfg("model.attnres.enabled=true")
    chunk = K3Chunk(cfg, 0, 1, first=True, last=False)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 5))
    assert chunk.embed_tokens(tokens).blocks[0].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        io = chunk.embed_tokens(tokens)
    assert io.blocks[0].dtype == torch.bfloat16
    torch.testing.assert_close(io.blocks[0].float(), chunk.embed(tokens), rtol=1e-2, atol=1e-3)


def test_mla_matches_written_out_attention(world1):
    layer = GatedMLA(hidden_size=16, num_heads=2, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4,
                     qk_rope_head_dim=3, v_head_dim=5, std=0.3).double()
    B, T = 2, 7
    x = torch.randn(B, T, 16, dtype=torch.float64)

    def norm(z, w):
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q = (norm(x @ layer.q_down.weight.T, layer.q_norm.weight) @ layer.q_up.weight.T).view(B, T, 2, 7)
    ckv = x @ layer.kv_down.weight.T
    kv = (norm(ckv[..., :6], layer.kv_norm.weight) @ layer.kv_up.weight.T).view(B, T, 2, 9)
    out = torch.zeros(B, T, 2, 5, dtype=torch.float64)
    for b in range(B):
        for h in range(2):
            for t in range(T):
                scores = []
                for s in range(t + 1):
                    key = torch.cat([kv[b, s, h, :4], ckv[b, s, 6:]])
                    scores.append((q[b, t, h] @ key) / math.sqrt(7))
                p = torch.softmax(torch.stack(scores), 0)
                out[b, t, h] = sum(p[s] * kv[b, s, h, 4:] for s in range(t + 1))
    out = out * torch.sigmoid(x @ layer.gate_proj.weight.T).view(B, T, 2, 5)
    ref = out.reshape(B, T, 10) @ layer.o_proj.weight.T
    torch.testing.assert_close(layer(x), ref, **TIGHT)


def test_situ_glu_ffn_formula(world1):
    ffn = SiTUGLU(hidden_size=8, intermediate_size=12, beta=4.0, beta_lin=25.0, std=0.5).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64) * 3
    g, u = x @ ffn.gate_proj.weight.T, x @ ffn.up_proj.weight.T
    h = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
    torch.testing.assert_close(ffn(x), h @ ffn.down_proj.weight.T, **TIGHT)


def test_depth_attention_zero_query_is_uniform_average():
    attn = DepthAttention(6).double()
    sources = [torch.randn(2, 3, 6, dtype=torch.float64) for _ in range(4)]
    torch.testing.assert_close(attn(sources), torch.stack(sources).mean(0), **TIGHT)


def test_depth_attention_softmax_over_normalised_sources():
    attn = DepthAttention(6).double()
    nn.init.normal_(attn.query)
    sources = [torch.randn(1, 2, 6, dtype=torch.float64) * (i + 1) for i in range(3)]
    logits = torch.stack([(s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * attn.query).sum(-1)
                          for s in sources])
    w = torch.softmax(logits, 0)
    ref = sum(w[i].unsqueeze(-1) * sources[i] for i in range(3))
    torch.testing.assert_close(attn(sources), ref, **TIGHT)


class _Scale(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return self.c * x


def _rms(x):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("index, closes", [(0, None), (1, 1)], ids=["mid-block", "block-end"])
def test_attnres_layer_partial_sums_and_block_closing(index, closes):
    layer = K3Layer(index=index, mixer=_Scale(2.0), ffn=_Scale(-0.5), hidden_size=4, attnres_block_size=2).double()
    b0 = torch.randn(1, 3, 4, dtype=torch.float64)
    partial = None if index == 0 else torch.randn(1, 3, 4, dtype=torch.float64)
    out = layer(StageIO(hidden=partial, blocks={0: b0}))
    srcs = [b0] if partial is None else [b0, partial]
    h = torch.stack(srcs).mean(0)  # zero queries: uniform average over the sources
    p = 2.0 * _rms(h) if partial is None else partial + 2.0 * _rms(h)
    p = p + (-0.5) * _rms(torch.stack([b0, p]).mean(0))
    assert layer.closes_block == closes
    if closes is None:
        assert set(out.blocks) == {0}
        torch.testing.assert_close(out.hidden, p, **TIGHT)
    else:
        assert out.hidden is None and set(out.blocks) == {0, 1}
        torch.testing.assert_close(out.blocks[1], p, **TIGHT)


def test_standard_residual_layer():
    layer = K3Layer(index=0, mixer=_Scale(2.0), ffn=_Scale(-0.5), hidden_size=4, attnres_block_size=None).double()
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    h = x + 2.0 * _rms(x)
    ref = h + (-0.5) * _rms(h)
    out = layer(StageIO(hidden=x, blocks={}))
    torch.testing.assert_close(out.hidden, ref, **TIGHT)


@pytest.mark.parametrize("attnres", [True, False], ids=["attnres", "standard"])
def test_chunks_compose_to_the_whole_model(world1, attnres):
    cfg = tiny_cfg(f"model.attnres.enabled={attnres}", "model.attnres.block_size=1")
    tokens = torch.randint(0, 257, (2, 9))
    whole = build_model(cfg)
    first, second = K3Chunk(cfg, 0, 3, True, False), K3Chunk(cfg, 3, 4, False, True)
    ref = whole(tokens[:, :-1], tokens[:, 1:])
    io = first(tokens[:, :-1])
    if attnres:
        assert set(io.blocks) == {0, 1, 2, 3} and io.hidden is None
        assert produced_blocks(cfg, [(0, 3), (3, 4)]) == [[0, 1, 2, 3], [4]]
    torch.testing.assert_close(second(io, tokens[:, 1:]), ref, rtol=0, atol=0)


def test_layer_pattern_places_mixers(world1):
    cfg = tiny_cfg("model.layer_pattern=KM+MK")
    kinds = [type(layer.mixer).__name__ for layer in build_model(cfg).layers]
    assert kinds == ["KimiDeltaAttention", "GatedMLA", "GatedMLA", "KimiDeltaAttention"]


def test_parameter_counts_of_chunks_add_up_to_the_model(world1):
    from k3train.model.info import count_parameters

    cfg = tiny_cfg("model.layer_pattern=KM")
    whole = count_parameters(build_model(cfg), cfg.moe.topk, cfg.moe.num_experts)
    parts = [count_parameters(K3Chunk(cfg, *r, first=r[0] == 0, last=r[1] == 4), cfg.moe.topk,
                              cfg.moe.num_experts) for r in ((0, 1), (1, 4))]
    assert {k: parts[0][k] + parts[1][k] for k in whole} == whole
    assert whole["kda"] > 0 and whole["mla"] > 0 and whole["total"] == sum(
        p.numel() for p in build_model(cfg).parameters())
