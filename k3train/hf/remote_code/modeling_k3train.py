"""The k3train K3 model for ``transformers`` (``AutoModelForCausalLM``, ``trust_remote_code``).

Copied by ``k3train export-hf`` beside the weights; imports only ``torch`` and ``transformers``
(no k3train, no fla). Plain, readable torch that reproduces k3train's forward (fp32 on CPU to
about 1e-6 of its logits; tests/hf/test_hf_remote_code.py): the KDA recurrence runs token by
token, the MLA as explicit causal attention. Parameter names are the export's tensor names
(docs/hf_format.md). Shapes: B batch, T tokens, D hidden, H heads, K head width.

Layer ``i`` is a token mixer (KDA or gated MLA, ``linear_attn_config`` / ``k3train.model``'s
layer pattern) and an FFN (dense SiTU-GLU for the first ``dense_layers``, LatentMoE after);
with Block AttnRes every sublayer reads a softmax-over-depth mix of the completed blocks
instead of a running residual sum. No cache: generation recomputes the whole prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_k3train import K3Config


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 at least (fp64 stays fp64), as k3train computes norms, gates and the recurrence."""
    return torch.promote_types(x.dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: fla's in-kernel form, as k3train's KDA uses."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``[..., D]`` -> ``x / rms(x) * weight`` in x's dtype, computed in fp32 at least."""
    xf = x.to(_compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


class K3RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """SiTU(gate) * beta_lin * tanh(up / beta_lin), SiTU(g) = beta * tanh(g / beta) * sigmoid(g)."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (beta_lin * torch.tanh(up / beta_lin))


class K3SiTUMLP(nn.Module):
    """SiTU-GLU MLP ``[..., D] -> [..., D]`` (the dense FFN, each expert, the shared expert)."""

    def __init__(self, size: int, ffn: int, beta: float, beta_lin: float):
        super().__init__()
        self.beta, self.beta_lin = beta, beta_lin
        self.gate_proj = nn.Linear(size, ffn, bias=False)
        self.up_proj = nn.Linear(size, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.beta_lin))


class K3Router(nn.Module):
    """Sigmoid scores; top-k of ``scores + e_score_correction_bias`` picks the experts (the bias
    only selects); the picked unbiased scores, renormalised to sum 1, weight them."""

    def __init__(self, hidden: int, num_experts: int, topk: int):
        super().__init__()
        self.topk = topk
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, D]`` -> (indices ``[N, k]``, weights ``[N, k]``)."""
        ct = _compute_dtype(x)
        scores = torch.sigmoid(F.linear(x.to(ct), self.weight.to(ct)))
        indices = torch.topk(scores + self.e_score_correction_bias, self.topk, dim=-1)[1]
        picked = scores.gather(-1, indices)
        return indices, picked / picked.sum(dim=-1, keepdim=True)


class K3LatentMoE(nn.Module):
    """``out = latent_up_proj(RMSNorm(sum_k w_k E_k(latent_down_proj x))) + shared_experts(x)``:
    routed SiTU-GLU experts in the latent width, the router and shared expert on the full width."""

    def __init__(self, config: K3Config):
        super().__init__()
        m, moe, s = config.k3train["model"], config.k3train["moe"], config.situ
        d, latent = m["hidden_size"], moe["latent_size"]
        self.gate = K3Router(d, moe["num_experts"], moe["topk"])
        self.latent_down_proj = nn.Linear(d, latent, bias=False)
        self.experts = nn.ModuleList(
            K3SiTUMLP(latent, moe["expert_ffn_size"], s["expert_beta"], s["expert_beta_lin"])
            for _ in range(moe["num_experts"]))
        self.latent_norm = K3RMSNorm(latent, 1e-6)  # k3train's LatentMoE norm has a fixed eps
        self.latent_up_proj = nn.Linear(latent, d, bias=False)
        n_shared = moe["num_shared_experts"]
        self.shared_experts = (K3SiTUMLP(d, n_shared * moe["shared_ffn_size"], s["expert_beta"],
                                         s["expert_beta_lin"]) if n_shared > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, D]`` -> ``[B, T, D]``."""
        x2 = x.reshape(-1, x.shape[-1])
        indices, weights = self.gate(x2)
        latent = self.latent_down_proj(x2)
        routed = torch.zeros_like(latent)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(indices == e)
            if rows.numel():
                y = expert(latent[rows]) * weights[rows, slot, None].to(latent.dtype)
                routed.index_add_(0, rows, y)
        out = self.latent_up_proj(self.latent_norm(routed))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2)
        return out.reshape(x.shape)


def kda_recurrence(q, k, v, g, beta):
    """Kimi Delta Attention token by token. q, k ``[B, T, H, K]`` (L2-normalised), v
    ``[B, T, H, V]``, g log-decay ``[B, T, H, K]``, beta ``[B, T, H]`` -> o ``[B, T, H, V]``::

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(K)
    """
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        k_t = k[:, t]
        S = S * g[:, t].exp().unsqueeze(-1)
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + beta[:, t, :, None, None] * k_t.unsqueeze(-1) * err.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S))
    return torch.stack(out, dim=1)


class K3DeltaAttention(nn.Module):
    """KDA: q, k, v = SiLU(causal depthwise conv(linear x)); log-decay
    ``g = lb * sigmoid(exp(A_log) * (f_b_proj(f_a_proj x) + dt_bias))``; beta = sigmoid(b_proj x);
    out = o_proj(RMSNorm_per_head(KDA(q, k, v)) * o_norm.weight * sigmoid(g_proj x))."""

    def __init__(self, config: K3Config):
        super().__init__()
        m = config.k3train["model"]
        kda = m["kda"]
        d, H, K, W = m["hidden_size"], kda["num_heads"], kda["head_dim"], kda["conv_size"]
        self.H, self.K, self.eps, self.lower_bound = H, K, m["norm_eps"], kda["gate_lower_bound"]
        width = H * K
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, width, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(width, width, W, groups=width, bias=False) for _ in range(3))
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.b_proj = nn.Linear(d, H, bias=False)
        self.g_proj = nn.Linear(d, width, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(H, K))  # one norm weight per head
        self.o_proj = nn.Linear(width, d, bias=False)

    def _qkv(self, proj: nn.Linear, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]`` -> ``[B, T, H, K]``: causal (left-padded) depthwise conv, then SiLU."""
        B, T, _ = x.shape
        y = F.pad(proj(x).transpose(1, 2), (conv.kernel_size[0] - 1, 0))
        y = F.conv1d(y, conv.weight.to(x.dtype), groups=conv.groups).transpose(1, 2)
        return F.silu(y).reshape(B, T, self.H, self.K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        shape = (B, T, self.H, self.K)
        ct = _compute_dtype(x)
        q = l2norm(self._qkv(self.q_proj, self.q_conv1d, x).to(ct))
        k = l2norm(self._qkv(self.k_proj, self.k_conv1d, x).to(ct))
        v = self._qkv(self.v_proj, self.v_conv1d, x).to(ct)
        f = self.f_b_proj(self.f_a_proj(x)).view(shape).to(ct)
        a = torch.exp(self.A_log.to(ct))[:, None]
        g = self.lower_bound * torch.sigmoid(a * (f + self.dt_bias.view(self.H, self.K).to(ct)))
        beta = torch.sigmoid(self.b_proj(x).to(ct))
        o = kda_recurrence(q, k, v, g, beta).to(x.dtype)
        o = rms_norm(o, self.o_norm.weight, self.eps) * torch.sigmoid(self.g_proj(x).view(shape)).to(x.dtype)
        return self.o_proj(o.reshape(B, T, -1))


class K3GatedMLA(nn.Module):
    """Multi-head latent attention without rotary (KDA layers carry position), low-rank query,
    and a sigmoid output gate: out = o_proj(attention * sigmoid(g_proj x))."""

    def __init__(self, config: K3Config):
        super().__init__()
        m = config.k3train["model"]
        a, d, eps = m["mla"], m["hidden_size"], m["norm_eps"]
        self.H, self.nope, self.rope, self.v_dim = a["num_heads"], a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
        self.kv_rank = a["kv_lora_rank"]
        self.scale = (self.nope + self.rope) ** -0.5
        self.q_a_proj = nn.Linear(d, a["q_lora_rank"], bias=False)
        self.q_a_layernorm = K3RMSNorm(a["q_lora_rank"], eps)
        self.q_b_proj = nn.Linear(a["q_lora_rank"], self.H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = K3RMSNorm(self.kv_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, self.H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(self.H * self.v_dim, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.H
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, self.nope + self.rope)
        c_kv, k_shared = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, H, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_shared.unsqueeze(2).expand(B, T, H, self.rope)], dim=-1)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        attn = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        gate = torch.sigmoid(self.g_proj(x)).view(B, T, H, self.v_dim)
        return self.o_proj((attn * gate).reshape(B, T, H * self.v_dim))


class K3AttnRes(nn.Module):
    """The layer's two Block AttnRes pseudo-queries (``mixer_query``, ``ffn_query``, ``[D]``)."""

    def __init__(self, d: int):
        super().__init__()
        self.mixer_query = nn.Parameter(torch.zeros(d))
        self.ffn_query = nn.Parameter(torch.zeros(d))


def depth_mix(query: torch.Tensor, sources: list[torch.Tensor], eps: float) -> torch.Tensor:
    """S sources ``[B, T, D]`` -> ``sum_i softmax_i(query . RMSNorm(v_i)) v_i`` ``[B, T, D]``
    (softmax over the sources, fp32 at least), in the first source's dtype."""
    v = torch.stack(sources)
    v = v.to(_compute_dtype(v))
    weights = torch.softmax((rms_norm(v, None, eps) * query.to(v.dtype)).sum(-1), dim=0)
    return (weights.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, index: int, kind: str):
        super().__init__()
        m = config.k3train["model"]
        d, eps = m["hidden_size"], m["norm_eps"]
        self.index, self.eps = index, eps
        self.input_layernorm = K3RMSNorm(d, eps)
        self.self_attn = K3DeltaAttention(config) if kind == "K" else K3GatedMLA(config)
        self.post_attention_layernorm = K3RMSNorm(d, eps)
        if index < m["dense_layers"]:
            s = config.situ
            self.mlp = K3SiTUMLP(d, m["ffn"]["intermediate_size"], s["ffn_beta"], s["ffn_beta_lin"])
        else:
            self.mlp = K3LatentMoE(config)
        self.block_size = m["attnres"]["block_size"] if m["attnres"]["enabled"] else None
        if self.block_size is not None:
            self.attn_res = K3AttnRes(d)

    def forward(self, h: torch.Tensor | None, blocks: list[torch.Tensor]):
        """Standard residual: h ``[B, T, D]`` -> h. AttnRes: h is the open block's partial sum
        (None right after a block closed), blocks the completed ones; returns the new partial
        sum, or None after appending the block this layer closes to ``blocks``."""
        if self.block_size is None:
            h = h + self.self_attn(self.input_layernorm(h))
            return h + self.mlp(self.post_attention_layernorm(h))
        sources = blocks if h is None else blocks + [h]
        y = self.self_attn(self.input_layernorm(depth_mix(self.attn_res.mixer_query, sources, self.eps)))
        h = y if h is None else h + y
        h = h + self.mlp(self.post_attention_layernorm(depth_mix(self.attn_res.ffn_query, blocks + [h], self.eps)))
        if (self.index + 1) % self.block_size:
            return h
        blocks.append(h)
        return None


class K3FinalAttnRes(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d))


def layer_kinds(config: K3Config) -> str:
    """One letter per layer, ``K`` (KDA) or ``M`` (MLA), from ``linear_attn_config``."""
    kda = set(config.linear_attn_config["kda_layers"])
    return "".join("K" if i + 1 in kda else "M" for i in range(config.num_hidden_layers))


class K3PreTrainedModel(PreTrainedModel):
    config_class = K3Config
    base_model_prefix = "model"
    _no_split_modules = ["K3DecoderLayer"]

    def _init_weights(self, module):
        # Only for tensors a checkpoint lacks (none in a k3train export): k3train's init scale.
        std = self.config.k3train["model"].get("init_std", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)


class K3Model(K3PreTrainedModel):
    """Embedding, the layers, the final AttnRes mix (when enabled) and the final norm."""

    def __init__(self, config: K3Config):
        super().__init__(config)
        m = config.k3train["model"]
        d = m["hidden_size"]
        self.attnres = m["attnres"]["enabled"]
        self.eps = m["norm_eps"]
        self.embed_tokens = nn.Embedding(m["vocab_size"], d)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i, kind) for i, kind in enumerate(layer_kinds(config)))
        if self.attnres:
            self.final_attn_res = K3FinalAttnRes(d)
        self.norm = K3RMSNorm(d, self.eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[B, T]`` -> normed hidden states ``[B, T, D]``."""
        h = self.embed_tokens(input_ids)
        blocks = [h] if self.attnres else []
        h = None if self.attnres else h
        for layer in self.layers:
            h = layer(h, blocks)
        if self.attnres:
            h = depth_mix(self.final_attn_res.query, blocks if h is None else blocks + [h], self.eps)
        return self.norm(h)


class K3ForCausalLM(K3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: K3Config):
        super().__init__(config)
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs) -> dict:
        # No cache: every step reads the whole sequence so far (transformers' default would pass
        # only the new token, expecting a cache to hold the rest).
        return {"input_ids": input_ids}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids ``[B, T]`` -> logits ``[B, T, vocab]`` (and the mean next-token loss given
        ``labels`` ``[B, T]``, shifted here as in transformers' causal LMs). Padding is not
        supported: ``attention_mask`` must be all ones."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("the k3train model has no padding support: pass unpadded input_ids")
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
