"""Gated multi-head latent attention (DeepSeek-style low-rank q/kv, NoPE, sigmoid output gate).

q = q_up(RMSNorm(q_down x)) per head [nope + rope]; kv_down x = [c_kv, k_shared];
[k_nope, v] = kv_up(RMSNorm(c_kv)) per head; k = [k_nope, k_shared broadcast over heads].
No rotary embedding: KDA layers supply position. Gate (arXiv 2505.06708):
out = o_proj(attn * sigmoid(W_g x)). Heads are sharded over tensor-parallel ranks.
Under context parallelism (``cp_group`` set, ``K3Chunk.use_context_parallel``) x holds this
rank's pieces of the sequence (``cp_partition``): the compact latent ``kv_down x`` is
all-gathered, put in sequence order and expanded to the prefix this rank's queries see
(``mla_attention_cp``); each query attends at its global position. With no rotary embedding no
position is applied to keys or queries.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from k3train.ops.layers import (
    ColumnLinear, RMSNorm, RowLinear, divide, replicated_linear, sum_grad_over_tp, tp_size,
)
from k3train.model.recompute import keep_output
from k3train.model.cp_documents import same_document_causal_mask_at
from k3train.model.mixer_pieces import MixerPiece
from k3train.ops.context_parallel import CPCommLog, all_gather_cp, cp_pieces, cp_token_index, global_order, mla_attention_cp
from k3train.ops.documents import document_attention


class GatedMLA(nn.Module):
    halo = 0   # a token piece reads no tokens before it beside its latent prefix (forward_piece)

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, std: float = 0.02,
                 out_std: float | None = None, eps: float = 1e-6):
        super().__init__()
        self.num_heads = divide(num_heads, tp_size(), "model.mla.num_heads")
        self.nope, self.rope, self.v_dim, self.kv_rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        self.q_down = replicated_linear(hidden_size, q_lora_rank, std)
        self.q_norm = RMSNorm(q_lora_rank, eps)
        self.q_up = ColumnLinear(q_lora_rank, num_heads * (qk_nope_head_dim + qk_rope_head_dim), std)
        self.kv_down = replicated_linear(hidden_size, kv_lora_rank + qk_rope_head_dim, std)
        self.kv_norm = RMSNorm(kv_lora_rank, eps)
        self.kv_up = ColumnLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), std)
        self.gate_proj = ColumnLinear(hidden_size, num_heads * v_head_dim, std)
        self.o_proj = RowLinear(num_heads * v_head_dim, hidden_size, out_std or std)
        self.cp_group = None  # context parallelism, as KimiDeltaAttention's
        self.cp_log: CPCommLog | None = None
        self.cp_partition = "contiguous"

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent ``[B, S, kv_lora_rank + rope]`` -> (k ``[B, S, H, nope + rope]``, v ``[B, S, H, v_dim]``)."""
        B, S, _ = latent.shape
        H = self.num_heads
        c_kv, k_shared = latent.split([self.kv_rank, self.rope], dim=-1)
        k_shared = sum_grad_over_tp(k_shared)  # feeds only this rank's heads
        k_nope, v = self.kv_up(self.kv_norm(c_kv)).view(B, S, H, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_shared.unsqueeze(2).expand(B, S, H, self.rope)], dim=-1), v

    def _documents_cp(self, q: torch.Tensor, latent: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``mla_attention_cp`` with a document mask: q ``[B, T, H, Dqk]``, latent ``[B, T, R]``
        (this rank's pieces), cu_seqlens the whole windows' (``cp * T`` tokens per row) ->
        ``[B, T, H, v_dim]``. The gathered latent, in sequence order, is expanded up to the end of
        this rank's last piece and each query attends the earlier keys of its own document."""
        B, T = q.shape[:2]
        rank, size = dist.get_rank(self.cp_group), dist.get_world_size(self.cp_group)
        pieces = cp_pieces(rank, size, self.cp_partition)
        keys = (max(pieces) + 1) * (T // len(pieces))
        gathered = all_gather_cp(latent, group=self.cp_group, dim=1, log=self.cp_log, tag="mla")
        k, v = self._expand(global_order(gathered, size, self.cp_partition)[:, :keys])
        positions = cp_token_index(size * T, rank, size, self.cp_partition, device=q.device)
        mask = same_document_causal_mask_at(cu_seqlens, B, size * T, positions, keys)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, scale=self.scale).transpose(1, 2)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]. cu_seqlens: document boundaries ``[N+1]`` over the
        flattened ``B*T`` tokens (``k3train.ops.documents``): each token attends only to earlier
        tokens of its own document (SDPA with a block-diagonal causal mask); None: plain causal."""
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_up(self.q_norm(self.q_down(x))).view(B, T, H, self.nope + self.rope)
        latent = self.kv_down(x)
        if self.cp_group is not None and cu_seqlens is None:
            attn = keep_output(mla_attention_cp, q, latent, self._expand, group=self.cp_group,
                               scale=self.scale, log=self.cp_log, partition=self.cp_partition)
        elif self.cp_group is not None:
            attn = keep_output(self._documents_cp, q, latent, cu_seqlens)
        else:
            k, v = self._expand(latent)
            # The attention core's output is kept under train.recompute=selective. With documents,
            # long ones attend one causal call each and short ones through one dense mask
            # (document_attention): the same code path on CPU and GPU.
            qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            if cu_seqlens is None:
                attn = keep_output(F.scaled_dot_product_attention, *qkv, is_causal=True, scale=self.scale)
            else:
                attn = keep_output(document_attention, *qkv, cu_seqlens, scale=self.scale)
            attn = attn.transpose(1, 2)  # [B, T, H, v_dim]
        gate = torch.sigmoid(self.gate_proj(x)).view(B, T, H, self.v_dim)
        return self.o_proj((attn * gate).reshape(B, T, H * self.v_dim))

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, D]`` -> the compact latent ``kv_down x`` ``[B, T, kv_lora_rank + rope]``."""
        return self.kv_down(x)

    def forward_piece(self, x: torch.Tensor, piece: MixerPiece,
                      latent: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``forward`` of the tokens ``[piece.start, piece.end)`` (``k3train/model/mixer_pieces.py``):
        x ``[B, n, D]`` the piece's tokens, latent ``[B, end, R]`` the latent of every token up to
        the piece's end -> (``[B, n, D]``, None: nothing is handed to the next piece). Each query
        attends the earlier keys of its document. Not under context parallelism."""
        if self.cp_group is not None:
            raise RuntimeError("MLA pieces (train.recompute_pieces) do not run under context parallelism")
        B, n, _ = x.shape
        H = self.num_heads
        q = self.q_up(self.q_norm(self.q_down(x))).view(B, n, H, self.nope + self.rope)
        k, v = self._expand(latent)
        attn = keep_output(self._attend_piece, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), piece)
        gate = torch.sigmoid(self.gate_proj(x)).view(B, n, H, self.v_dim)
        return self.o_proj((attn.transpose(1, 2) * gate).reshape(B, n, H * self.v_dim)), None

    def _attend_piece(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: MixerPiece) -> torch.Tensor:
        """q ``[B, H, n, Dqk]`` at positions ``[start, end)``, k ``[B, H, end, Dqk]``, v
        ``[B, H, end, Dv]`` -> ``[B, H, n, Dv]``: causal with the queries aligned to the keys'
        end (lower right); with documents one call per document the piece meets."""
        n, e = q.shape[2], k.shape[2]
        if piece.spans is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, e), scale=self.scale)
        s = piece.start
        rows = []
        for b, spans in enumerate(piece.spans):
            parts = [F.scaled_dot_product_attention(q[b:b + 1, :, lo - s:hi - s], k[b:b + 1, :, a:hi],
                                                    v[b:b + 1, :, a:hi], scale=self.scale,
                                                    attn_mask=causal_lower_right(hi - lo, hi - a))
                     for a, lo, hi in spans]
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)
