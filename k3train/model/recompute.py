"""Activation checkpointing of K3 layers (``train.recompute``: none | selective | full).

``full``: each layer runs inside one non-reentrant ``torch.utils.checkpoint`` region. Autograd
stores only the region's inputs (the hidden state / partial sum and the AttnRes blocks the layer
reads) and recomputes everything else in backward. Non-reentrant because it composes with the
pipeline engine's partial backwards (``run_backward`` on a chunk's roots), with saved-tensor
hooks (the engine's ``_SavedStorages`` sees the region's inputs and keeps their data) and with
CUDA graph capture (no RNG state is read: ``preserve_rng_state=False``, see ``run_layer``).

``selective``: the same region, but the outputs of the costly cores marked with
``keep_output`` (the KDA recurrence, the MLA attention) are kept from the forward, and the
tensors the core saves for its own backward are saved for real; the recompute returns the kept
output instead of running the core again, so only the norms, projections, short convs, gates,
depth mixes and the FFN (SiTU-GLU, MoE) are recomputed. torch's op-level policy
(``create_selective_checkpoint_contexts``) cannot do this here: on CUDA the KDA core is fla's
Triton autograd.Function, whose kernels a dispatch-mode policy never sees as one op.

AttnRes: the blocks are region inputs, stored once (in the pipeline's block cache under PP) and
shared by every layer that reads them; nothing inside a region saves them again under ``full``,
and under ``selective`` only the cores' own inputs are saved, never a block. The final depth
mix before the head gets a region of its own (``run_depth_mix``) for the same reason.

Side effects: a recomputed forward writes its forward state again (MoE routing records, load
counts, aux loss, recorded depth weights). ``_LayerRegion`` snapshots the layer's forward-state
holders (``k3train/model/forward_state.py``, the protocol the CUDA-graph wrapper uses too)
before a recompute and restores them after, so balancers and metrics see each forward once.
Routing itself is identical on recompute: the inputs are the stored ones, the router bias only
changes after the optimizer step, and the model draws no random numbers.

Offload (``train.offload_activations``, ``k3train/model/offload.py``): the hooks of an
``ActivationOffload`` are opened around the checkpoint call, so what the region keeps (its
inputs; under ``selective`` also the cores' kept outputs and saved tensors, which go through the
hooks active at the call) is kept in host memory, and what is saved inside the region stays a
checkpoint placeholder. With what a region keeps off the device, a finer cut costs the device
nothing, so under offload each layer is two regions, its mixer half and its FFN half
(``K3Layer.mixer_half``, ``ffn_half``): the backward then holds one half's recomputed
activations at a time instead of the whole layer's (at 1M tokens on k3_mini, the MoE half's
~40 GiB instead of the layer's ~71 GiB; docs/long_context.md). ``train.recompute_pieces`` cuts
the FFN half and the mixer half (KDA: with its conv halo and the recurrent state handed from
piece to piece; MLA: a region for the whole window's latent, then each piece's queries against
their prefix; ``k3train/model/mixer_pieces.py``) into token pieces, a region each.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from k3train.config.schema import RECOMPUTE_MODES
from k3train.model.forward_state import forward_state_holders, restore, snapshot
from k3train.model.mixer_pieces import attention_piece, mixer_piece, piece_bounds
from k3train.model.offload import ActivationOffload
from pipeline.stage_io import StageIO

# The region being run (forward or recompute) on this thread. Thread-local because CUDA backward
# runs recomputes on autograd's device threads; it is set and cleared around each run.
_active = threading.local()


def _identity(t):
    return t


class _LayerRegion:
    """The function a checkpoint region runs: ``(hidden, *blocks) -> run(StageIO)``, ``run``
    the whole layer (default) or one of its halves (``mixer_half``, ``ffn_half``).

    The first call is the forward, later calls are recomputes (one per backward graph task).
    outer_hooks: the saved-tensor hooks active around the region (e.g. the pipeline engine's),
    applied to what ``keep_output`` saves for real so they still see every saved tensor.
    """

    def __init__(self, *, layer: nn.Module, block_ids: list[int], selective: bool, outer_hooks,
                 segments: torch.Tensor | None = None, run=None):
        self.layer, self.block_ids, self.selective = layer, block_ids, selective
        self.run = run if run is not None else layer
        # The document boundaries are metadata (no gradient): held here, so the recompute sees
        # the very tensor the forward saw.
        self.segments = segments
        self.outer_hooks = outer_hooks or (_identity, _identity)
        self.calls = 0
        self.recomputing = False
        # Per keep_output call of the forward, in call order: (packed output, requires_grad), or a
        # tuple of those (None for a None) where the core returns several (a KDA piece's state).
        self.kept: list = []
        self.next_kept = 0

    def __call__(self, hidden, *tensors) -> StageIO:
        # The blocks in id order, then what ``run`` takes besides the StageIO (a KDA piece's state).
        blocks, extra = tensors[:len(self.block_ids)], tensors[len(self.block_ids):]
        self.recomputing, self.next_kept = self.calls > 0, 0
        self.calls += 1
        holders = forward_state_holders(self.layer) if self.recomputing else []
        states = snapshot(holders)
        previous = getattr(_active, "region", None)
        _active.region = self
        try:
            return self.run(StageIO(hidden=hidden, blocks=dict(zip(self.block_ids, blocks)),
                                    segments=self.segments), *extra)
        finally:
            _active.region = previous
            restore(holders, states)


def keep_output(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a tensor, or a tuple of tensors and Nones); under ``selective``
    recompute its output is kept.

    Outside a selective region this is a plain call. In a selective forward, ``fn`` saves its
    tensors for real (not as recompute placeholders) and its output is kept; in the recompute
    the kept output comes back without running ``fn``.
    """
    region = getattr(_active, "region", None)
    if region is None or not region.selective:
        return fn(*args, **kwargs)
    pack, unpack = region.outer_hooks
    if region.recomputing:
        kept = region.kept[region.next_kept]
        region.next_kept += 1
        # Leaves that require grad, so the ops after them save what they saved in the forward.
        back = [None if k is None else unpack(k[0]).detach().requires_grad_(k[1]) for k in kept]
        return tuple(back) if isinstance(kept, tuple) else back[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*args, **kwargs)
    # The kept output is a saved tensor of the region: it goes through the same hooks.
    outs = out if isinstance(out, tuple) else [out]
    kept = [None if t is None else (pack(t.detach()), t.requires_grad) for t in outs]
    region.kept.append(tuple(kept) if isinstance(out, tuple) else kept)
    return out


def _offloading(offload: ActivationOffload | None):
    return offload.hooks() if offload is not None else contextlib.nullcontext()


def run_layer(layer: nn.Module, io: StageIO, mode: str, offload: ActivationOffload | None = None,
              pieces: int = 1) -> StageIO:
    """``layer(io)`` under the recompute ``mode`` (one of ``RECOMPUTE_MODES``).

    Without grad (eval) there is nothing to recompute and the layer runs plainly. The region's
    inputs are ``io.hidden`` (``[B, T, D]`` or None) and the blocks ``[B, T, D]`` in id order.
    preserve_rng_state=False: no K3 layer draws random numbers (no dropout), and reading the CUDA
    RNG state would be recorded by a CUDA graph capture; a layer that adds dropout must revisit it.
    offload: keep what the regions save in host memory (module docstring), and checkpoint the
    layer as two regions, ``layer.mixer_half`` then ``layer.ffn_half`` (the mixer's output is one
    more kept tensor, on the host); only with recompute (``train.offload_activations`` needs
    ``full`` or ``selective``).
    pieces: under offload, both halves as that many regions over consecutive token pieces
    (``train.recompute_pieces``, ``_ffn_in_pieces``, ``_mixer_in_pieces``,
    ``_attention_in_pieces``).
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    if mode == "none" or not torch.is_grad_enabled():
        return layer(io)
    with _offloading(offload):
        if offload is None:
            return _region(layer, io, mode)
        # What the regions keep lives on the host, so a finer cut costs the device nothing: the
        # mixer and the FFN halves are regions of their own, and the backward recomputes one
        # half at a time (the peak is the larger half's activations, not the whole layer's).
        kind = _piece_kind(layer) if pieces > 1 else None
        if kind == "kda":
            mid = _mixer_in_pieces(layer, io, mode, pieces, offload)
        elif kind == "mla":
            mid = _attention_in_pieces(layer, io, mode, pieces, offload)
        else:
            mid = _region(layer, io, mode, layer.mixer_half)
        ffn_io = StageIO(hidden=mid, blocks=io.blocks, segments=io.segments)
        if pieces > 1:
            return _ffn_in_pieces(layer, ffn_io, mode, pieces)
        return _region(layer, ffn_io, mode, layer.ffn_half)


def _ffn_in_pieces(layer: nn.Module, io: StageIO, mode: str, pieces: int) -> StageIO:
    """``layer.ffn_half(io)`` as ``pieces`` regions over consecutive token pieces of every row.

    Everything in the FFN half is per token (its norm, depth mix, dense FFN or MoE: routing,
    experts and the quantile/aux-free statistics read from the step's records, which the pieces
    append in order), so the pieces give the whole half's output; the config refuses what is
    not per token (the aux loss's window statistics, the static dispatcher's capacity, expert
    parallelism's collectives; ``layout_rules.layout_refusal``). What it saves: the backward
    recomputes one piece at a time, so the device holds one piece's FFN activations instead of
    the whole window's (the MoE half is the larger half of a layer's planned activations; on one
    H200 that moved k3_mini's 256K peak by 1%, docs/long_context.md). A
    block's pieces are views of the block, which the mixer half saved whole: the offload keeps
    them as views of that one host copy (``ActivationOffload.pack``).
    io.hidden ``[B, T, D]``, io.blocks ``{id: [B, T, D]}`` -> the half's StageIO, whole ``T``."""
    T = io.hidden.shape[1]
    sizes = [e - s for s, e in piece_bounds(T, pieces)]
    hidden = io.hidden.split(sizes, dim=1)
    blocks = {i: b.split(sizes, dim=1) for i, b in io.blocks.items()}
    outs = [_region(layer, StageIO(hidden=hidden[j], blocks={i: b[j] for i, b in blocks.items()}),
                    mode, layer.ffn_half) for j in range(len(sizes))]
    new = [i for i in outs[0].blocks if i not in io.blocks]   # the block this layer closes, if any
    return StageIO(hidden=None if outs[0].hidden is None else torch.cat([o.hidden for o in outs], dim=1),
                   blocks={**io.blocks, **{i: torch.cat([o.blocks[i] for o in outs], dim=1) for i in new}},
                   segments=io.segments)


def _piece_kind(layer: nn.Module) -> str | None:
    """How the layer's mixer half runs in token pieces: ``"kda"`` (the conv's halo and the
    recurrent state handed on), ``"mla"`` (the latent of the whole window, then each piece's
    queries against their prefix), or None (whole) under context parallelism, whose exchanges
    own the sequence there."""
    if getattr(layer.mixer, "cp_group", None) is not None or not hasattr(layer.mixer, "forward_piece"):
        return None
    return "mla" if hasattr(layer.mixer, "latent") else "kda"


def _prepack(offload: ActivationOffload | None, tensors) -> None:
    """The whole tensors to the host once, before pieces save (overlapping) views of them: each
    piece then keeps views of these copies (``ActivationOffload.pack``)."""
    if offload is not None:
        for t in tensors:
            if t is not None:
                offload.pack(t)


def _window(io: StageIO) -> tuple[int, int, torch.device, list[int] | None]:
    """(rows B, tokens T, device, the document boundaries read to the host once, or None) of a
    half's inputs: the pieces' boundaries all come from one read (a read waits for the device)."""
    ref = io.hidden if io.hidden is not None else io.blocks[min(io.blocks)]
    return ref.shape[0], ref.shape[1], ref.device, None if io.segments is None else io.segments.tolist()


def _tokens(io: StageIO, lo: int, hi: int) -> StageIO:
    """The half's inputs over the tokens ``[lo, hi)`` of every row (views)."""
    return StageIO(hidden=None if io.hidden is None else io.hidden[:, lo:hi],
                   blocks={i: b[:, lo:hi] for i, b in io.blocks.items()})


def _mixer_in_pieces(layer: nn.Module, io: StageIO, mode: str, pieces: int,
                     offload: ActivationOffload | None) -> torch.Tensor:
    """``layer.mixer_half(io)`` as ``pieces`` regions over consecutive token pieces, each with
    the conv's halo of tokens before it and the recurrence's state after the piece before as
    inputs (``k3train/model/mixer_pieces.py``). io.hidden ``[B, T, D]`` or None, io.blocks
    ``{id: [B, T, D]}`` -> ``[B, T, D]``."""
    B, T, device, docs = _window(io)
    _prepack(offload, [io.hidden, *io.blocks.values()])
    bounds = piece_bounds(T, pieces)
    state, outs = None, []
    for j, (s, e) in enumerate(bounds):
        piece = mixer_piece(s, e, halo=layer.mixer.halo, hand_over=j < len(bounds) - 1, cu_seqlens=docs,
                            batch=B, seq_len=T, device=device)
        out, state = _region(layer, _tokens(io, s - piece.halo, e), mode,
                             functools.partial(layer.mixer_half_piece, piece=piece), extra=(state,))
        outs.append(out)
    return torch.cat(outs, dim=1)


def _attention_in_pieces(layer: nn.Module, io: StageIO, mode: str, pieces: int,
                         offload: ActivationOffload | None) -> torch.Tensor:
    """An MLA layer's ``mixer_half(io)`` as a region making the whole window's latent, then
    ``pieces`` regions over consecutive token pieces, each with its tokens' inputs and the
    latent of every token up to its end (``k3train/model/mixer_pieces.py``). io.hidden
    ``[B, T, D]`` or None, io.blocks ``{id: [B, T, D]}`` -> ``[B, T, D]``."""
    B, T, _, docs = _window(io)
    _prepack(offload, [io.hidden, *io.blocks.values()])
    latent = _region(layer, io, mode, layer.mixer_latent)
    _prepack(offload, [latent])
    outs = []
    for s, e in piece_bounds(T, pieces):
        piece = attention_piece(s, e, cu_seqlens=docs, batch=B, seq_len=T)
        out, _ = _region(layer, _tokens(io, s, e), mode, functools.partial(layer.mixer_half_piece, piece=piece),
                         extra=(latent[:, :e],))
        outs.append(out)
    return torch.cat(outs, dim=1)


def _region(layer: nn.Module, io: StageIO, mode: str, run=None, extra: tuple = ()):
    """``run(io, *extra)`` (default the whole layer) in one checkpoint region; its inputs are
    ``io.hidden``, the blocks in id order and ``extra``."""
    ids = sorted(io.blocks)
    region = _LayerRegion(layer=layer, block_ids=ids, selective=mode == "selective",
                          outer_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
                          segments=io.segments, run=run)
    return checkpoint(region, io.hidden, *(io.blocks[i] for i in ids), *extra,
                      use_reentrant=False, preserve_rng_state=False)


def run_depth_mix(mix: nn.Module, sources: list[torch.Tensor], mode: str,
                  offload: ActivationOffload | None = None) -> torch.Tensor:
    """``mix(sources)`` (the final AttnRes depth mix, outside every layer region) under ``mode``.

    With recompute on, it runs in its own checkpoint region: its inputs are the blocks, already
    stored once, so nothing new is kept; without it the torch form would keep a stacked fp32
    copy of every block (``S x [B, T, D]``, twice), which made AttnRes cost more than the
    standard residual under ``full``. sources: S tensors ``[B, T, D]`` -> ``[B, T, D]``.
    offload: its inputs (the blocks, copied once for every region that saves them) on the host.
    """
    if mode == "none" or not torch.is_grad_enabled():
        return mix(sources)
    with _offloading(offload):
        return checkpoint(lambda *s: mix(list(s)), *sources, use_reentrant=False, preserve_rng_state=False)
