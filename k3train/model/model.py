"""The K3 model as a list of chunks: each chunk owns a contiguous range of layers.

A single-device model is one chunk holding everything; a pipeline rank builds only its chunks.
Every layer is initialised from its own seed (run seed, layer index), so a chunk holds exactly
the weights that the same layers hold in the single-device model: this is what lets the
pipeline tests compare gradients against a one-process run.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from k3train.errors import LayoutError
from k3train.config.schema import RunConfig
from k3train.model.attnres import DepthAttention
from k3train.ops.layers import RMSNorm
from k3train.model.ffn import SiTUGLU
from k3train.model.kda_layer import KimiDeltaAttention
from k3train.model.layer import K3Layer
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.model.mla import GatedMLA
from k3train.model.offload import ActivationOffload
from k3train.model.recompute import run_depth_mix, run_layer
from k3train.ops.context_parallel import CPCommLog
from k3train.runtime.distributed import expert_group_in_force
from k3train.quant.recipes import apply_precision, fp8_region, resolve_device
from moe import GroupedAllToAllDispatcher, LatentMoE, LocalDispatcher
from moe.norm import autocast_dtype
from moe.balancing import reads_step_scores
from pipeline.stage_io import StageIO

_EMBED_SALT, _HEAD_SALT = 0, 1_000_003


@contextlib.contextmanager
def seeded(seed: int, salt: int):
    """Draw parameters from a private RNG stream so construction order does not matter."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 7919 + salt)
        yield


def build_dispatcher(cfg: RunConfig, ep_group: dist.ProcessGroup | None = None):
    """The token dispatcher of every MoE layer: local, or grouped all-to-all over ``ep_group``.

    ep_group: the run's expert-parallel group (``RunContext.parallel.ep_group``; size 1 at
    ep=1). None (builders that hold no run context: model-info, the HF and MXFP4 translators)
    takes ``expert_group_in_force``: megatron-core's expert group where the groups exist."""
    kind = cfg.moe.dispatcher
    if kind == "auto":     # static capacity (moe.capacity_factor) is a grouped_a2a mode
        static = cfg.moe.capacity_factor is not None
        kind = "grouped_a2a" if cfg.parallel.ep > 1 or static else "local"
    if kind == "local":     # the config refused local with ep > 1 or a capacity factor
        return LocalDispatcher(cfg.moe.num_experts)
    if ep_group is None:
        ep_group = expert_group_in_force(cfg.parallel.ep)
    return GroupedAllToAllDispatcher(cfg.moe.num_experts, ep_group=ep_group, capacity_factor=cfg.moe.capacity_factor)


def moe_layer_indices(cfg: RunConfig) -> list[int]:
    """Global indices of the layers whose FFN is a LatentMoE (all after the dense ones)."""
    return list(range(cfg.model.dense_layers, cfg.model.num_layers))


def build_layer(cfg: RunConfig, index: int, ep_group: dist.ProcessGroup | None = None) -> K3Layer:
    """Layer ``index`` (global); ``ep_group``: the MoE dispatcher's group (``build_dispatcher``)."""
    m, moe = cfg.model, cfg.moe
    kind = expand_layer_pattern(m.layer_pattern, m.num_layers)[index]
    std = m.init_std
    out_std = std / math.sqrt(2 * m.num_layers)  # residual-branch outputs shrink with depth
    with seeded(cfg.train.seed, 1 + index):
        if kind == "K":
            k = m.kda
            mixer = KimiDeltaAttention(hidden_size=m.hidden_size, num_heads=k.num_heads, head_dim=k.head_dim,
                                       conv_size=k.conv_size, gate_lower_bound=k.gate_lower_bound,
                                       chunk_size=k.chunk_size, std=std, out_std=out_std, eps=m.norm_eps,
                                       gate=k.gate)
        else:
            a = m.mla
            mixer = GatedMLA(hidden_size=m.hidden_size, num_heads=a.num_heads, q_lora_rank=a.q_lora_rank,
                             kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                             qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                             std=std, out_std=out_std, eps=m.norm_eps)
        if index not in moe_layer_indices(cfg):
            ffn = SiTUGLU(hidden_size=m.hidden_size, intermediate_size=m.ffn.intermediate_size,
                          beta=m.ffn.situ_beta, beta_lin=m.ffn.situ_beta_lin, std=std, out_std=out_std)
        else:
            ffn = LatentMoE(hidden_size=m.hidden_size, latent_size=moe.latent_size, num_experts=moe.num_experts,
                            topk=moe.topk, expert_ffn_size=moe.expert_ffn_size,
                            num_shared_experts=moe.num_shared_experts, shared_ffn_size=moe.shared_ffn_size,
                            dispatcher=build_dispatcher(cfg, ep_group),
                            aux_loss_coef=moe.aux_loss_coef if moe.balancing == "aux_loss" else 0.0,
                            init_std=std, keep_step_scores=reads_step_scores(moe.balancing))
        block = m.attnres.block_size if m.attnres.enabled else None
        return K3Layer(index=index, mixer=mixer, ffn=ffn, hidden_size=m.hidden_size,
                       attnres_block_size=block, eps=m.norm_eps,
                       aux_grad_scale=1.0 / cfg.train.microbatches)


def produced_blocks(cfg: RunConfig, ranges: list[tuple[int, int]]) -> list[list[int]]:
    """For each chunk (layer range), the global AttnRes block ids it completes (0 = embedding)."""
    m = cfg.model
    if not m.attnres.enabled:
        return [[] for _ in ranges]
    size = m.attnres.block_size
    out = []
    for c, (start, end) in enumerate(ranges):
        ids = [0] if c == 0 else []
        ids += [(i + 1) // size for i in range(start, end) if (i + 1) % size == 0]
        out.append(ids)
    return out


class K3Chunk(nn.Module):
    """Layers ``[start, end)``; the first chunk adds the embedding, the last the output head.

    forward: first chunk takes token ids ``[B, T]``, others a ``StageIO``; the last chunk returns
    the mean cross-entropy over ``targets [B, T]`` (or logits ``[B, T, vocab]`` without targets),
    the others a ``StageIO``. ``segments``: the first chunk's document boundaries (``cu_seqlens``
    ``[N+1]`` over the flattened ``B*T`` tokens, ``k3train.ops.documents``; None: one document
    per row); later chunks read them from the ``StageIO``. ``loss_tokens``: divide the summed
    token losses by this instead of averaging over this call's own targets (context
    parallelism: each rank holds part of every window, see ``use_context_parallel``).
    """

    def __init__(self, cfg: RunConfig, start: int, end: int, first: bool, last: bool, *,
                 ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        m = cfg.model
        self.first, self.last, self.attnres = first, last, m.attnres.enabled
        self.layer_range = (start, end)
        self.recompute = cfg.train.recompute  # activation checkpointing of each layer (recompute.py)
        # What recompute keeps, in host memory (offload.py); None: on the device.
        self.offload = ActivationOffload() if cfg.train.offload_activations else None
        # Under offload, each layer's FFN half recomputes in this many token pieces.
        self.recompute_pieces = cfg.train.recompute_pieces
        if first:
            with seeded(cfg.train.seed, _EMBED_SALT):
                self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
                nn.init.normal_(self.embed.weight, std=m.init_std)
        self.layers = nn.ModuleList(build_layer(cfg, i, ep_group) for i in range(start, end))
        if last:
            with seeded(cfg.train.seed, _HEAD_SALT):
                if self.attnres:
                    self.final_res = DepthAttention(m.hidden_size, m.norm_eps)
                self.final_norm = RMSNorm(m.hidden_size, m.norm_eps)
                self.head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
                nn.init.normal_(self.head.weight, std=m.init_std)
            if m.tie_embeddings:
                if not first:
                    raise LayoutError("model.tie_embeddings needs the embedding and head in one chunk (pp=1)")
                self.head.weight = self.embed.weight
        # The precision recipe is part of what the layers are: configured here, at build time.
        # A pipeline chunk may legitimately hold none of a scope pattern's modules.
        self.quantized = apply_precision(self, cfg.precision, resolve_device(cfg.train.device),
                                         layer_offset=start, require_match=first and last)
        # Transformer Engine's fp8 autocast around each forward under precision.fp8_backend=te.
        self.fp8_region = fp8_region(cfg.precision)

    def embed_tokens(self, tokens: torch.Tensor, segments: torch.Tensor | None = None) -> StageIO:
        h = self.embed(tokens)
        if self.attnres:
            # The fused depth mix wants every source in one dtype. Under autocast the blocks are
            # sums of bf16 sublayer outputs, so the embedding joins them in bf16 here, once,
            # instead of every mix casting every block to fp32 (an activation-sized copy each).
            h = h.to(autocast_dtype(h) or h.dtype)
        if self.attnres:
            return StageIO(hidden=None, blocks={0: h}, segments=segments)
        return StageIO(hidden=h, blocks={}, segments=segments)

    def logits(self, io: StageIO) -> torch.Tensor:
        if self.attnres:
            done = [io.blocks[i] for i in sorted(io.blocks)]
            h = run_depth_mix(self.final_res, done if io.hidden is None else done + [io.hidden],
                              self.recompute, self.offload)
        else:
            h = io.hidden
        return self.head(self.final_norm(h))

    def use_context_parallel(self, group, log: CPCommLog | None = None, partition: str = "contiguous") -> None:
        """Run every token mixer on this rank's pieces of each sequence (``partition``, the run's
        ``parallel.cp_partition``: one contiguous chunk, or head-tail pieces r and
        ``2 cp - 1 - r`` concatenated; ``k3train.ops.context_parallel.cp_token_index``), exchanging
        what it needs over the context-parallel ``group`` (KDA's state fold and conv halo, MLA's
        latent; ``k3train.ops.context_parallel``); ``log`` records the bytes. Per-token parts
        (embedding, norms, AttnRes, FFN/MoE, head) need nothing. Every rank of the group must
        run every forward and backward (the exchanges are collectives). The MoE layers take their
        balance loss's statistics over ``group`` (``moe.switch_aux_loss``)."""
        self.cp_log = log
        for layer in self.layers:
            layer.mixer.cp_group, layer.mixer.cp_log, layer.mixer.cp_partition = group, log, partition
            if isinstance(layer.ffn, LatentMoE):  # its balance loss counts every rank's tokens
                layer.ffn.cp_group = group

    def forward(self, x, targets: torch.Tensor | None = None, segments: torch.Tensor | None = None,
                loss_tokens: float | torch.Tensor | None = None):
        with self.fp8_region():
            io = self.embed_tokens(x, segments) if self.first else x
            for layer in self.layers:
                io = run_layer(layer, io, self.recompute, self.offload, self.recompute_pieces)
            if not self.last:
                return io
            logits = self.logits(io)
        if targets is None:
            return logits
        if loss_tokens is not None:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / loss_tokens
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def moe_layers(self) -> list[nn.Module]:
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, LatentMoE)]

    def moe_layer_indices(self) -> list[int]:
        """Global layer index of each entry of ``moe_layers()``."""
        return [layer.index for layer in self.layers if isinstance(layer.ffn, LatentMoE)]


def build_model(cfg: RunConfig, *, ep_group: dist.ProcessGroup | None = None) -> K3Chunk:
    """The whole model as one chunk (single device, or the reference for pipeline tests);
    ``ep_group``: the run's expert-parallel group (``build_dispatcher``)."""
    return K3Chunk(cfg, 0, cfg.model.num_layers, first=True, last=True, ep_group=ep_group)
