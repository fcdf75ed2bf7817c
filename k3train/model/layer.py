"""One K3 layer: a token mixer (KDA or gated MLA) and an FFN (dense SiTU-GLU or LatentMoE).

The layer reads and writes a ``StageIO``, the same object that crosses pipeline stages:
* standard residual: ``hidden`` is the residual stream, ``blocks`` is empty;
* Block AttnRes: ``blocks`` holds completed blocks by global index (0 = embedding) and
  ``hidden`` the current block's partial sum (None right after a block closed).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from k3train.model.attnres import DepthAttention
from k3train.ops.layers import RMSNorm
from moe import LatentMoE
from pipeline.stage_io import StageIO


class AuxLossAttach(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends ``scale`` into ``aux``.

    Lets a layer deep inside a pipeline chunk contribute a loss term (the MoE balance loss)
    without returning it through every stage boundary.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class K3Layer(nn.Module):
    def __init__(self, *, index: int, mixer: nn.Module, ffn: nn.Module, hidden_size: int,
                 attnres_block_size: int | None, eps: float = 1e-6, aux_grad_scale: float = 1.0):
        super().__init__()
        self.index = index
        # The balance loss's gradient weight: 1/microbatches, as the main loss is averaged.
        self.aux_grad_scale = aux_grad_scale
        self.mixer_norm, self.mixer = RMSNorm(hidden_size, eps), mixer
        self.ffn_norm, self.ffn = RMSNorm(hidden_size, eps), ffn
        self.block_size = attnres_block_size
        if attnres_block_size is not None:
            self.mixer_res = DepthAttention(hidden_size, eps)
            self.ffn_res = DepthAttention(hidden_size, eps)

    @property
    def closes_block(self) -> int | None:
        """Global index of the AttnRes block this layer completes, if any."""
        if self.block_size is None or (self.index + 1) % self.block_size:
            return None
        return (self.index + 1) // self.block_size

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        y = self.ffn(self.ffn_norm(h))
        # The MoE balance loss of this forward (``balancing: aux_loss``), taken from the layer's
        # routing record (which keeps it detached, so no graph outlives the step); dense FFNs
        # have none.
        aux = self.ffn.routing.take_aux_loss() if isinstance(self.ffn, LatentMoE) else None
        if aux is not None and torch.is_grad_enabled():
            y = AuxLossAttach.apply(y, aux, self.aux_grad_scale)
        return y

    def _mix(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        # Without documents the mixer is called as before: the inference cache's mixer twins
        # (k3train/infer/cache.py, one prompt = one document) take x alone.
        return self.mixer(x) if segments is None else self.mixer(x, segments)

    def forward(self, io: StageIO) -> StageIO:
        """The mixer reads ``io.segments`` (document boundaries, ``cu_seqlens``); the FFN, the
        norms and the depth mixes are per token and need none. The output carries them on."""
        return self.ffn_half(StageIO(hidden=self.mixer_half(io), blocks=io.blocks, segments=io.segments))

    def _mixer_in(self, io: StageIO) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the mixer's normalised input ``[B, T, D]``, what its output adds to: the residual
        stream, the block's partial sum, or None right after a block closed)."""
        if self.block_size is None:
            return self.mixer_norm(io.hidden), io.hidden
        done = [io.blocks[i] for i in sorted(io.blocks)]
        partial = io.hidden
        h = self.mixer_res(done if partial is None else done + [partial])
        return self.mixer_norm(h), partial

    def mixer_half(self, io: StageIO) -> torch.Tensor:
        """The mixer sublayer: the residual stream after it ``[B, T, D]`` (with AttnRes, the
        block's partial sum). Split from ``ffn_half`` so that recompute can checkpoint the two
        halves as separate regions (``k3train/model/recompute.py``, under offload)."""
        x, base = self._mixer_in(io)
        y = self._mix(x, io.segments)
        return y if base is None else base + y

    def mixer_half_piece(self, io: StageIO, carry: torch.Tensor | None, *, piece) -> tuple:
        """``mixer_half`` of the tokens ``[piece.start, piece.end)`` (``MixerPiece``,
        ``k3train/model/mixer_pieces.py``): io holds them with the ``piece.halo`` tokens before;
        carry: what the mixer's piece takes besides (KDA: the recurrence's state after the piece
        before; MLA: the latent of every token up to the piece's end) -> (the stream after the
        mixer over the piece ``[B, n, D]``, what goes to the next piece: KDA's state, or None)."""
        x, base = self._mixer_in(io)
        y, after = self.mixer.forward_piece(x, piece, carry)
        return (y if base is None else base[:, piece.halo:] + y), after

    def mixer_latent(self, io: StageIO) -> torch.Tensor:
        """An MLA mixer's compact latent over the whole window ``[B, T, R]`` (``GatedMLA.latent``
        of the mixer's input), what its pieces expand into keys and values."""
        return self.mixer.latent(self._mixer_in(io)[0])

    def ffn_half(self, io: StageIO) -> StageIO:
        """The FFN sublayer on ``io.hidden``, ``mixer_half``'s output; with AttnRes it closes the
        layer's block where it ends one."""
        seg = io.segments
        if self.block_size is None:
            h = io.hidden
            return StageIO(hidden=h + self._ffn(h), blocks=io.blocks, segments=seg)
        done = [io.blocks[i] for i in sorted(io.blocks)]
        partial = io.hidden
        partial = partial + self._ffn(self.ffn_res(done + [partial]))
        closed = self.closes_block
        if closed is None:
            return StageIO(hidden=partial, blocks=io.blocks, segments=seg)
        return StageIO(hidden=None, blocks={**io.blocks, closed: partial}, segments=seg)
