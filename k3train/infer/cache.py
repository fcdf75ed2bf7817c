"""Incremental (cached) forward of the one-process K3 model, for generation.

``CachedModel(model)`` swaps every layer's token mixer for a cached twin sharing its weights;
``model(tokens [B, T])`` then returns logits ``[B, T, vocab]`` for tokens that *continue*
everything fed since the last ``reset()``. What each layer keeps, per sequence:

* KDA: the recurrent state ``S [B, H, K, V]`` (fp32 at least) and the last ``conv_size - 1``
  inputs of each of the q / k / v short convolutions ``[B, W-1, H*K]``. A prefill of T > 1
  tokens runs the training layer's own chunked call (``kda_gated_state``: fla's safe-gate
  kernel on CUDA) from the state; one token runs the recurrence (fla's ``fused_recurrent_kda``
  on CUDA, the naive one elsewhere).
* gated MLA: the normalised latent ``c [B, S, kv_lora_rank]`` and the shared rope key
  ``k_r [B, S, rope]``; per-head keys and values are never formed. Decode is absorbed
  (MQA-mode): ``q_nope W_uk`` turns each head's query into the latent space, all heads score
  against the one latent sequence, and ``W_uv`` maps the attended latent to each head's value.
* AttnRes: nothing across time. The depth mix runs per token over that token's blocks, which
  the layer rebuilds for the new tokens as it goes.

Cache bytes per token: ``cache_bytes_per_token``; a full KV cache stores
``H * (qk_nope + qk_rope + v_head)`` numbers per MLA layer and token instead of
``kv_lora_rank + qk_rope``, and KDA layers keep a constant-size state instead of a growing one.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from k3train.errors import UsageError
from k3train.model.kda_layer import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from k3train.ops import fla_kernel
from k3train.ops.gated_norm import head_norm_gate_torch
from k3train.ops.kda import kda_gated_state, l2norm
from k3train.ops.kda.naive import naive_recurrent_kda
from k3train.ops.short_conv import short_conv_silu_torch


def _recurrent_kda(q, k, v, g, beta, state):
    """One or a few tokens of KDA from ``state``: fla's fused recurrence on CUDA, else the naive one."""
    fused = fla_kernel("kda", q.device, "fla.ops.kda", "fused_recurrent_kda")
    if fused is not None:
        dt = v.dtype
        return fused(q.to(dt), k.to(dt), v, g.float(), beta.to(dt), initial_state=state.float(),
                     output_final_state=True)
    return naive_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)


class CachedKDA(nn.Module):
    """``KimiDeltaAttention``'s forward continuing from its cache (same weights, not copied)."""

    def __init__(self, inner: KimiDeltaAttention):
        super().__init__()
        self.inner = inner
        self.cache: dict[str, torch.Tensor] = {}

    def _conv(self, key: str, proj, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raw = proj(x)  # [B, T, C]
        width = weight.shape[1]
        prev = self.cache.get(key)
        if prev is None:  # zeros before the first token, as the training conv pads
            prev = raw.new_zeros(raw.shape[0], width - 1, raw.shape[2])
        full = torch.cat([prev, raw], dim=1)
        if width > 1:
            self.cache[key] = full[:, full.shape[1] - (width - 1):]
        y = short_conv_silu_torch(full, weight)[:, width - 1:]
        m = self.inner
        return y.view(x.shape[0], x.shape[1], m.num_heads, m.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] (the tokens after those already cached) -> [B, T, D]."""
        m, (B, T, _) = self.inner, x.shape
        shape = (B, T, m.num_heads, m.head_dim)
        v = self._conv("v", m.v_proj, m.v_conv, x)
        q = self._conv("q", m.q_proj, m.q_conv, x)
        k = self._conv("k", m.k_proj, m.k_conv, x)
        f, dt_bias = m.gate_inputs(x)
        b = m.b_proj(x)
        state = self.cache.get("S")
        if state is None:
            state = torch.zeros(B, m.num_heads, m.head_dim, m.head_dim, device=x.device,
                                dtype=torch.promote_types(v.dtype, torch.float32))
        if T == 1:
            ct = state.dtype  # fp32 at least; fp64 stays (tests)
            q = l2norm(q.to(ct)).to(v.dtype)   # the training path's form (fla's, eps inside the sqrt)
            k = l2norm(k.to(ct)).to(v.dtype)
            g = m.lower_bound * torch.sigmoid(torch.exp(m.A_log.to(ct))[:, None] * (f.to(ct) + dt_bias.to(ct)))
            o, state = _recurrent_kda(q, k, v, g, torch.sigmoid(b.to(ct)), state)
        else:  # the training layer's own call (kda_gated), continued from the state
            o, state = kda_gated_state(q, k, v, f, b, m.A_log, dt_bias, m.lower_bound,
                                       initial_state=state, output_final_state=True)
        self.cache["S"] = state
        o = head_norm_gate_torch(o, m.o_norm_weight, m.g_proj(x).view(shape), m.eps)
        return m.o_proj(o.reshape(B, T, -1).to(x.dtype))


class CachedMLA(nn.Module):
    """``GatedMLA``'s forward against a cache of the compressed latent, decoded in absorbed form."""

    def __init__(self, inner: GatedMLA):
        super().__init__()
        self.inner = inner
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] (the tokens after those already cached) -> [B, T, D]."""
        m, (B, T, _) = self.inner, x.shape
        H, nope, rope, vd, rank = m.num_heads, m.nope, m.rope, m.v_dim, m.kv_rank
        q = m.q_up(m.q_norm(m.q_down(x))).view(B, T, H, nope + rope)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        c_kv, k_rope = m.kv_down(x).split([rank, rope], dim=-1)
        c = m.kv_norm(c_kv)
        if "c" in self.cache:
            c, k_rope = torch.cat([self.cache["c"], c], 1), torch.cat([self.cache["k_rope"], k_rope], 1)
        self.cache["c"], self.cache["k_rope"] = c, k_rope
        S = c.shape[1]
        w = m.kv_up.weight.view(H, nope + vd, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, rank], [H, v, rank]
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk.to(q.dtype))
        scores = (torch.einsum("bthr,bsr->bhts", q_lat, c) +
                  torch.einsum("bthe,bse->bhts", q_rope, k_rope)) * m.scale
        # Query t sits at position S - T + t and sees keys 0 .. S - T + t.
        future = torch.arange(S, device=x.device)[None, :] > (S - T + torch.arange(T, device=x.device))[:, None]
        ct = torch.promote_types(scores.dtype, torch.float32)  # fp32 at least; fp64 stays (tests)
        p = torch.softmax(scores.to(ct).masked_fill(future, float("-inf")), dim=-1).to(c.dtype)
        latent = torch.einsum("bhts,bsr->bthr", p, c)
        attn = torch.einsum("bthr,hvr->bthv", latent, w_uv.to(c.dtype))
        gate = torch.sigmoid(m.gate_proj(x)).view(B, T, H, vd)
        return m.o_proj((attn * gate).reshape(B, T, H * vd))


class CachedModel(nn.Module):
    """The one-process model (a ``K3Chunk`` holding every layer) with cached mixers.

    The mixers are swapped in place (no weight copies): from then on ``model`` itself runs the
    cached forward. forward: tokens ``[B, T]`` continuing the cached ones -> logits ``[B, T, vocab]``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if not (getattr(model, "first", False) and getattr(model, "last", False)):
            raise UsageError("generation needs the whole model in one process (parallel.pp=1)")
        self.model, self.mixers = model, []
        for layer in model.layers:
            if isinstance(layer.mixer, KimiDeltaAttention):
                layer.mixer = CachedKDA(layer.mixer)
            elif isinstance(layer.mixer, GatedMLA):
                layer.mixer = CachedMLA(layer.mixer)
            self.mixers.append(layer.mixer)
        self.length = 0

    def reset(self) -> None:
        for mixer in self.mixers:
            mixer.cache = {}
        self.length = 0

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        logits = self.model(tokens)
        self.length += tokens.shape[1]
        return logits

    def cache_bytes(self) -> int:
        """Bytes the cache holds now (all layers, the whole batch)."""
        return sum(t.numel() * t.element_size() for m in self.mixers for t in m.cache.values())


def cache_bytes_per_token(model: nn.Module, bytes_per_number: int = 2) -> dict:
    """Per token and sequence: the latent cache of the MLA layers against a full per-head KV
    cache of the same layers, and the KDA layers' constant state (bytes, not per token)."""
    latent = full = kda_state = 0
    for layer in model.layers:
        m = getattr(layer.mixer, "inner", layer.mixer)  # a cached twin or the mixer itself
        if isinstance(m, GatedMLA):
            latent += (m.kv_rank + m.rope) * bytes_per_number
            full += m.num_heads * (m.nope + m.rope + m.v_dim) * bytes_per_number
        elif isinstance(m, KimiDeltaAttention):
            kda_state += m.num_heads * m.head_dim * m.head_dim * 4  # fp32 state
            kda_state += 3 * (m.q_conv.shape[1] - 1) * m.num_heads * m.head_dim * bytes_per_number
    return {"mla_latent_bytes_per_token": latent, "mla_full_kv_bytes_per_token": full,
            "kda_state_bytes": kda_state}
