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

Two forms of the same arithmetic: the growing cache above (``cache``: tensors that grow, for
the prefill and for reference), and the static decode step (``static``, bound by
``k3train.infer.decoder``): one token per sequence against preallocated buffers updated in
place, with the MLA latent in ``L`` fixed slots and each sequence's position in a device tensor,
so that the step can be captured in a CUDA graph. Both share the projections, the recurrence and
the attention code (``_one_token``, ``_project``, ``_attend``).

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
        # The decode step's static buffers (``k3train.infer.decoder.bind``), None for the
        # growing-cache forward.
        self.static: dict[str, torch.Tensor] | None = None

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

    def _conv_static(self, key: str, proj, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``_conv`` for one token against the static tail ``static[key]`` ``[B, W-1, C]``,
        updated in place (same arithmetic: the window is the tail followed by the new input)."""
        raw = proj(x)  # [B, 1, C]
        width = weight.shape[1]
        if width > 1:
            tail = self.static[key]
            full = torch.cat([tail, raw.to(tail.dtype)], dim=1)  # [B, W, C]
            tail.copy_(full[:, 1:])
        else:
            full = raw
        y = short_conv_silu_torch(full, weight)[:, width - 1:]
        m = self.inner
        return y.view(x.shape[0], 1, m.num_heads, m.head_dim)

    def _one_token(self, q, k, v, f, dt_bias, b, state):
        """The recurrence for one token from ``state`` [B, H, K, V]: (o [B, 1, H, V], new state)."""
        m, ct = self.inner, state.dtype  # fp32 at least; fp64 stays (tests)
        q = l2norm(q.to(ct)).to(v.dtype)   # the training path's form (fla's, eps inside the sqrt)
        k = l2norm(k.to(ct)).to(v.dtype)
        g = m.lower_bound * torch.sigmoid(torch.exp(m.A_log.to(ct))[:, None] * (f.to(ct) + dt_bias.to(ct)))
        return _recurrent_kda(q, k, v, g, torch.sigmoid(b.to(ct)), state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] (the tokens after those already cached) -> [B, T, D]."""
        m, (B, T, _) = self.inner, x.shape
        shape = (B, T, m.num_heads, m.head_dim)
        if self.static is not None:
            return self._forward_static(x)
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
            o, state = self._one_token(q, k, v, f, dt_bias, b, state)
        else:  # the training layer's own call (kda_gated), continued from the state
            o, state = kda_gated_state(q, k, v, f, b, m.A_log, dt_bias, m.lower_bound,
                                       initial_state=state, output_final_state=True)
        self.cache["S"] = state
        o = head_norm_gate_torch(o, m.o_norm_weight, m.g_proj(x).view(shape), m.eps)
        return m.o_proj(o.reshape(B, T, -1).to(x.dtype))

    def _forward_static(self, x: torch.Tensor) -> torch.Tensor:
        """One token per sequence, x [B, 1, D] -> [B, 1, D], against the static buffers
        (``static``: ``S`` [B, H, K, V] and the tails ``q``/``k``/``v`` [B, W-1, H*K]), which
        it updates in place: no allocation that outlives the call, no host synchronisation,
        so the step can be captured in a CUDA graph (``k3train.infer.decoder``)."""
        m, (B, T, _) = self.inner, x.shape
        if T != 1:
            raise ValueError(f"the static decode step takes one token per sequence, got {T}")
        v = self._conv_static("v", m.v_proj, m.v_conv, x)
        q = self._conv_static("q", m.q_proj, m.q_conv, x)
        k = self._conv_static("k", m.k_proj, m.k_conv, x)
        f, dt_bias = m.gate_inputs(x)
        state = self.static["S"]
        o, new_state = self._one_token(q, k, v, f, dt_bias, m.b_proj(x), state)
        state.copy_(new_state)
        o = head_norm_gate_torch(o, m.o_norm_weight, m.g_proj(x).view(B, 1, m.num_heads, m.head_dim), m.eps)
        return m.o_proj(o.reshape(B, 1, -1).to(x.dtype))


class CachedMLA(nn.Module):
    """``GatedMLA``'s forward against a cache of the compressed latent, decoded in absorbed form."""

    def __init__(self, inner: GatedMLA):
        super().__init__()
        self.inner = inner
        self.cache: dict[str, torch.Tensor] = {}
        # The decode step's static buffers (``k3train.infer.decoder.bind``): ``c`` [B, L, rank], ``k_rope`` [B, L, rope]
        # and ``pos`` [B] int64 (where each sequence's next token goes); None otherwise.
        self.static: dict[str, torch.Tensor] | None = None

    def _project(self, x: torch.Tensor):
        """x [B, T, D] -> (q_nope [B, T, H, nope], q_rope [B, T, H, rope], c [B, T, rank], k_rope [B, T, rope])."""
        m, (B, T, _) = self.inner, x.shape
        q = m.q_up(m.q_norm(m.q_down(x))).view(B, T, m.num_heads, m.nope + m.rope)
        q_nope, q_rope = q.split([m.nope, m.rope], dim=-1)
        c_kv, k_rope = m.kv_down(x).split([m.kv_rank, m.rope], dim=-1)
        return q_nope, q_rope, m.kv_norm(c_kv), k_rope

    def _attend(self, x, q_nope, q_rope, c, k_rope, hidden: torch.Tensor) -> torch.Tensor:
        """Absorbed attention of the queries [B, T, H, *] over the latent keys c [B, S, rank] and
        k_rope [B, S, rope]; ``hidden`` [B or 1, T, S] bool marks the keys a query must not see.
        -> the layer's output [B, T, D]."""
        m, (B, T, _) = self.inner, x.shape
        H, nope, vd = m.num_heads, m.nope, m.v_dim
        w = m.kv_up.weight.view(H, nope + vd, m.kv_rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, rank], [H, v, rank]
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk.to(q_nope.dtype))
        scores = (torch.einsum("bthr,bsr->bhts", q_lat, c) +
                  torch.einsum("bthe,bse->bhts", q_rope, k_rope)) * m.scale
        ct = torch.promote_types(scores.dtype, torch.float32)  # fp32 at least; fp64 stays (tests)
        p = torch.softmax(scores.to(ct).masked_fill(hidden[:, None], float("-inf")), dim=-1).to(c.dtype)
        latent = torch.einsum("bhts,bsr->bthr", p, c)
        attn = torch.einsum("bthr,hvr->bthv", latent, w_uv.to(c.dtype))
        gate = torch.sigmoid(m.gate_proj(x)).view(B, T, H, vd)
        return m.o_proj((attn * gate).reshape(B, T, H * vd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] (the tokens after those already cached) -> [B, T, D]."""
        if self.static is not None:
            return self._forward_static(x)
        T = x.shape[1]
        q_nope, q_rope, c, k_rope = self._project(x)
        if "c" in self.cache:
            c, k_rope = torch.cat([self.cache["c"], c], 1), torch.cat([self.cache["k_rope"], k_rope], 1)
        self.cache["c"], self.cache["k_rope"] = c, k_rope
        S = c.shape[1]
        # Query t sits at position S - T + t and sees keys 0 .. S - T + t.
        future = torch.arange(S, device=x.device)[None, :] > (S - T + torch.arange(T, device=x.device))[:, None]
        return self._attend(x, q_nope, q_rope, c, k_rope, future[None])

    def _forward_static(self, x: torch.Tensor) -> torch.Tensor:
        """One token per sequence, x [B, 1, D] -> [B, 1, D]: writes its latent at ``pos`` of the
        fixed-length buffers and attends over all L slots with the slots after ``pos`` masked,
        so no shape depends on the length so far (capturable in a CUDA graph). Slots past a
        sequence's position hold zeros (``DecodeBuffers``): masked to weight 0, they add 0."""
        B, T, _ = x.shape
        if T != 1:
            raise ValueError(f"the static decode step takes one token per sequence, got {T}")
        q_nope, q_rope, c_new, k_rope_new = self._project(x)
        c, k_rope, pos = self.static["c"], self.static["k_rope"], self.static["pos"]
        at = pos.view(B, 1, 1)
        c.scatter_(1, at.expand(B, 1, c.shape[2]), c_new.to(c.dtype))
        k_rope.scatter_(1, at.expand(B, 1, k_rope.shape[2]), k_rope_new.to(k_rope.dtype))
        hidden = torch.arange(c.shape[1], device=x.device)[None, :] > pos[:, None]  # [B, L]
        return self._attend(x, q_nope, q_rope, c, k_rope, hidden[:, None])


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
