"""Kimi Delta Attention sublayer (Kimi Linear, arXiv 2510.26692) with K3's safe gate.

x -> q, k, v: linear -> causal depthwise short conv -> SiLU; q, k L2-normalised per head.
Forget gate (low rank d -> head_dim -> H*K): g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)),
a per-channel log-decay in (lower_bound, 0); with ``gate="head"`` f and dt_bias have one value per
head (linear d -> H), broadcast over its K channels: Gated DeltaNet's scalar decay, through the
same kernels. beta = sigmoid(linear d -> H).
o = KDA(q, k, v, g, beta); out = o_proj(RMSNorm_head(o) * sigmoid(W_gate x)).
Heads are sharded over tensor-parallel ranks; every per-head parameter is sharded with them.
Under context parallelism (``cp_group`` set, ``K3Chunk.use_context_parallel``) x holds this
rank's pieces of the sequence (``cp_partition``: one contiguous chunk, or pieces r and 2P-1-r):
the convs take the last tokens of the piece before each (``short_conv_cp``) and the recurrence
folds the state of the pieces before (``kda_cp``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from k3train.ops.layers import (
    ColumnLinear, RowLinear, divide, replicated_linear, sharded_param, tp_rank, tp_size,
)
from k3train.model.recompute import keep_output
from k3train.model.cp_documents import halo_cu_seqlens, pieces_document_starts
from k3train.model.mixer_pieces import MixerPiece, carried_state, initial_state
from k3train.ops.context_parallel import CPCommLog, cp_pieces, kda_cp, short_conv_cp
from k3train.ops.gated_norm import head_norm_gate
from k3train.ops.kda import kda_gated, kda_gated_state
from k3train.ops.short_conv import short_conv_silu


class KimiDeltaAttention(nn.Module):
    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, conv_size: int = 4,
                 gate_lower_bound: float = -5.0, chunk_size: int = 64, std: float = 0.02,
                 out_std: float | None = None, eps: float = 1e-6, gate: str = "channel"):
        super().__init__()
        if gate not in ("channel", "head"):
            raise ValueError(f"gate must be 'channel' (KDA) or 'head' (Gated DeltaNet's scalar decay), got {gate!r}")
        self.gate = gate
        tp, rank = tp_size(), tp_rank()
        self.num_heads = divide(num_heads, tp, "model.kda.num_heads")
        self.head_dim, self.lower_bound, self.chunk_size, self.eps = head_dim, gate_lower_bound, chunk_size, eps
        width = num_heads * head_dim
        self.q_proj = ColumnLinear(hidden_size, width, std)
        self.k_proj = ColumnLinear(hidden_size, width, std)
        self.v_proj = ColumnLinear(hidden_size, width, std)
        # Depthwise conv weights are drawn whole and sliced so every TP size sees the same model.
        bound = 1.0 / math.sqrt(conv_size)
        self.q_conv, self.k_conv, self.v_conv = (
            sharded_param(torch.empty(width, conv_size).uniform_(-bound, bound), tp, rank)
            for _ in range(3)
        )
        if gate == "channel":
            self.f_down = replicated_linear(hidden_size, head_dim, std)
            self.f_up = ColumnLinear(head_dim, width, std)
        else:
            self.f_head = ColumnLinear(hidden_size, num_heads, std)
        # A = exp(A_log) = 1 at init; dt_bias puts the per-step decay rate -g at init log-uniformly in
        # [1e-3, 1e-1] (long memory first), inverting g = lb * sigmoid(dt_bias).
        rate_shape = (num_heads, head_dim) if gate == "channel" else (num_heads,)
        rate = torch.exp(torch.empty(rate_shape).uniform_(math.log(1e-3), math.log(1e-1)))
        self.A_log = sharded_param(torch.zeros(num_heads), tp, rank)
        self.dt_bias = sharded_param(torch.logit(rate / abs(gate_lower_bound)), tp, rank)
        self.b_proj = ColumnLinear(hidden_size, num_heads, std)
        self.g_proj = ColumnLinear(hidden_size, width, std)
        # Per-head norm weights: a shared [K] weight would see only local heads under TP.
        self.o_norm_weight = sharded_param(torch.ones(num_heads, head_dim), tp, rank)
        self.o_proj = RowLinear(width, hidden_size, out_std or std)
        # Context parallelism: the CP process group (None: the whole sequence is here) and an
        # optional byte log of its exchanges; set by K3Chunk.use_context_parallel.
        self.cp_group = None
        self.cp_log: CPCommLog | None = None
        self.cp_partition = "contiguous"  # parallel.cp_partition

    # q, k and v keep one projection and one conv each, as fla's layer does. One GEMM over the
    # concatenated weights and one conv over 3HK channels was measured too and was slower, the
    # strided q/k/v views costing copies and a gradient concatenation that the separate form
    # avoids (measured: see benchmarks/README.md).
    def _qkv(self, proj: ColumnLinear, conv: torch.Tensor, x: torch.Tensor,
             cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Under CP, ``cu_seqlens`` are the boundaries of the conv's ``[halo, piece]`` rows
        (``halo_cu_seqlens``, rows ordered (row, slot) as ``short_conv_cp`` builds them)."""
        B, T, _ = x.shape
        if self.cp_group is not None:
            def conv_fn(z, w):
                return short_conv_silu(z, w, cu_seqlens)
            y = short_conv_cp(proj(x), conv, group=self.cp_group, log=self.cp_log, conv=conv_fn,
                              partition=self.cp_partition)
        else:
            y = short_conv_silu(proj(x), conv, cu_seqlens)
        return y.view(B, T, self.num_heads, self.head_dim)

    def _kda_cp(self, q, k, v, f, beta_logits, dt_bias, starts: list[list[int]] | None = None) -> torch.Tensor:
        """The layer's gated KDA on this rank's chunk, its state folded over the CP group.
        Shapes as ``kda_gated``; the fold calls the layer's own kernel (fla's fused gate on
        CUDA) through an adapter, with the wide values and the state arguments it needs.
        starts: per row, the local document starts (positions in ``[0, T)``); rows then run
        one fold each (their boundaries differ), None: one fold for the batch."""
        def gated(q, k, v, f, b, scale=None, initial_state=None, output_final_state=False):
            return kda_gated_state(q, k, v, f, b, self.A_log, dt_bias, self.lower_bound,
                                   initial_state=initial_state, output_final_state=output_final_state)

        if starts is None:
            return kda_cp(q, k, v, f, beta_logits, group=self.cp_group, kernel=gated, log=self.cp_log,
                          partition=self.cp_partition)
        return torch.cat([kda_cp(*(t[b:b + 1] for t in (q, k, v, f, beta_logits)), group=self.cp_group,
                                 kernel=gated, doc_starts=row, log=self.cp_log, partition=self.cp_partition)
                          for b, row in enumerate(starts)], dim=0)

    def gate_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D] -> (f [B, T, H, K], dt_bias [H, K]), what the gate reads; under
        ``gate="head"`` both are one value per head broadcast over the K channels."""
        B, T, _ = x.shape
        shape = (B, T, self.num_heads, self.head_dim)
        if self.gate == "channel":
            return self.f_up(self.f_down(x)).view(shape), self.dt_bias
        # Contiguous, as the channel gate's f is: the CUDA kernels read f with its strides.
        f = self.f_head(x).unsqueeze(-1).expand(shape).contiguous()
        return f, self.dt_bias.unsqueeze(-1).expand(self.num_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]. Under autocast the projections, KDA and output run in bf16;
        the gate, the norms and the sigmoids in fp32 (inside the kernels on CUDA).
        cu_seqlens: document boundaries ``[N+1]`` over the flattened ``B*T`` tokens
        (``k3train.ops.documents``): the short convs and the recurrent state restart at each;
        None: one sequence per row."""
        B, T, _ = x.shape
        shape = (B, T, self.num_heads, self.head_dim)
        starts = None
        if self.cp_group is not None and cu_seqlens is not None:
            # Under CP, cu_seqlens are the whole windows' (cp * T tokens per row); the rank holds
            # L pieces of n tokens, concatenated.
            rank, size = dist.get_rank(self.cp_group), dist.get_world_size(self.cp_group)
            pieces = cp_pieces(rank, size, self.cp_partition)
            L, n = len(pieces), T // len(pieces)
            per_piece = pieces_document_starts(cu_seqlens, B, size * T, pieces, n)
            starts = [[s * n + i for s in range(L) for i in per_piece[b * L + s]] for b in range(B)]
            # The conv's rows are [halo, piece]: a document starting inside the halo cuts it too.
            width = self.q_conv.shape[1] - 1
            halo_starts = pieces_document_starts(cu_seqlens, B, size * T, pieces, n, before=width)
            cu_seqlens = halo_cu_seqlens(halo_starts, n + width, x.device)
        v = self._qkv(self.v_proj, self.v_conv, x, cu_seqlens)
        q = self._qkv(self.q_proj, self.q_conv, x, cu_seqlens)
        k = self._qkv(self.k_proj, self.k_conv, x, cu_seqlens)
        f, dt_bias = self.gate_inputs(x)
        # The KDA core's output is kept under train.recompute=selective (costly to recompute).
        if self.cp_group is not None:
            o = keep_output(self._kda_cp, q, k, v, f, self.b_proj(x), dt_bias, starts)
        else:
            o = keep_output(kda_gated, q, k, v, f, self.b_proj(x), self.A_log, dt_bias, self.lower_bound,
                            cu_seqlens=cu_seqlens)
        o = head_norm_gate(o, self.o_norm_weight, self.g_proj(x).view(shape), self.eps)
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype))

    @property
    def halo(self) -> int:
        """Tokens before a token that its output reads outside the recurrence (the conv's)."""
        return self.q_conv.shape[1] - 1

    def forward_piece(self, x: torch.Tensor, piece: MixerPiece,
                      state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` of the tokens ``[piece.start, piece.end)`` of the window, continuing from
        ``state`` (``k3train/model/mixer_pieces.py``). x ``[B, halo + n, D]``: the piece with
        its ``piece.halo`` tokens before; state ``[B, H, K, V]`` after the piece before (None for
        the first) -> (``[B, n, D]``, the state after this piece ``[B, H, K, V]``, or None for
        the last). Not under context parallelism (the fold owns the state there)."""
        if self.cp_group is not None:
            raise RuntimeError("KDA pieces (train.recompute_pieces) do not run under context parallelism")
        B, n = x.shape[0], x.shape[1] - piece.halo
        h, shape = piece.halo, (B, n, self.num_heads, self.head_dim)
        v, q, k = (self._qkv(p, c, x, piece.conv_cu)[:, h:]
                   for p, c in ((self.v_proj, self.v_conv), (self.q_proj, self.q_conv), (self.k_proj, self.k_conv)))
        xs = x[:, h:]
        f, dt_bias = self.gate_inputs(xs)
        o, after = keep_output(self._kda_piece, q, k, v, f, self.b_proj(xs), dt_bias, piece, state)
        o = head_norm_gate(o, self.o_norm_weight, self.g_proj(xs).view(shape), self.eps)
        return self.o_proj(o.reshape(B, n, -1).to(x.dtype)), after

    def _kda_piece(self, q, k, v, f, beta_logits, dt_bias, piece: MixerPiece, state):
        """The recurrence over one piece from ``state``: (o ``[B, n, H, V]``, the rows' states
        after it or None)."""
        o, final = kda_gated_state(q, k, v, f, beta_logits, self.A_log, dt_bias, self.lower_bound,
                                   initial_state=initial_state(piece, state),
                                   output_final_state=piece.hand_over, cu_seqlens=piece.core_cu)
        return o, (carried_state(piece, final) if piece.hand_over else None)
