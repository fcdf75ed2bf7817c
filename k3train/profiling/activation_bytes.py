"""Activation bytes per token of one layer and of the head, per recompute mode and op set: the
formulas the memory planner (k3train/profiling/memory_plan.py) sums over its schedule. What
each term counts, and how it is checked, is in memory_plan's module docstring and
docs/memory.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from k3train.config import RunConfig
from k3train.config.layer_pattern import expand_layer_pattern
from moe.balancing import reads_step_scores

# The chunk both KDA paths run with: fla's chunk_kda and chunk_kda_torch's default are 64 wide
# (model.kda.chunk_size is not passed to either today).
_KDA_CHUNK = 64


@dataclass
class Widths:
    """The model's widths after tensor parallelism (head-sharded widths divided by tp)."""

    D: int; W: int; H: int; K: int; C: int           # hidden; KDA width, heads, head dim, chunk
    Hm: int; qk: int; v: int; ql: int; kvl: int; rope: int   # MLA (per rank: Hm heads)
    F: int; E: int; k: int; L: int; Fe: int; Fs: int  # dense FFN, experts, topk, latent, expert/shared FFN
    V: int

    @classmethod
    def of(cls, cfg: RunConfig) -> "Widths":
        m, moe, tp = cfg.model, cfg.moe, cfg.parallel.tp
        a = m.mla
        return cls(D=m.hidden_size, W=m.kda.num_heads * m.kda.head_dim // tp, H=m.kda.num_heads // tp,
                   K=m.kda.head_dim, C=_KDA_CHUNK, Hm=a.num_heads // tp,
                   qk=a.qk_nope_head_dim + a.qk_rope_head_dim, v=a.v_head_dim, ql=a.q_lora_rank,
                   kvl=a.kv_lora_rank, rope=a.qk_rope_head_dim, F=m.ffn.intermediate_size // tp,
                   E=moe.num_experts, k=moe.topk, L=moe.latent_size, Fe=moe.expert_ffn_size,
                   Fs=moe.num_shared_experts * moe.shared_ffn_size, V=m.vocab_size)


OPS = ("fused", "fused-eager", "torch")


def _eager(ops: str) -> bool:
    """Whether norms and SiTU-GLU run op by op (torch forms; ``kernels.compile=false`` on CUDA)."""
    return ops in ("torch", "fused-eager")


def _norm(n: int, a: int, f: int, ops: str) -> float:
    """RMSNorm of width n: eager keeps its fp32 input, the rstd and the unweighted output;
    the compiled kernel its input and the rstd."""
    return (2 * n * f + f) if _eager(ops) else (n * a + f)


def _kda_core(w: Widths, T: int, a: int, f: int, ops: str) -> float:
    """What the KDA recurrence keeps, per token (its q/k/v/gate inputs included)."""
    if ops == "torch":
        # chunk_kda_torch: fp32 chunk tensors per padded token (Tp/T): pairwise decays over the
        # n = C/sub sub-chunks (4nW), the within-sub-chunk decays (3 sub W), the solve's C-wide
        # rows (3HC) and 16 more W-wide tensors; the gate/norm prep keeps 4W + 5H.
        sub = math.gcd(w.C, 8)
        n, Tp = w.C // sub, math.ceil(T / w.C) * w.C
        core = (16 * w.W + 4 * n * w.W + 3 * sub * w.W + 3 * w.H * w.C + w.H) * f
        return core * Tp / T + (4 * w.W + 5 * w.H) * f
    # fla chunk_kda with gate, l2norm and beta in the kernel (fla 0.6.0, ChunkKDAFunction's
    # save_for_backward): the normalised q and k, v and the raw gate input in the activation
    # dtype, the beta logits, the fp32 sigmoid beta and the two fp32 rstd of the norms, and the
    # C-wide intra-chunk matrices Aqk and Akk in k's dtype (chunk_kda_fwd_intra allocates them
    # so). The cumulated log-decay is not kept: with the gate in the kernel it is recomputed in
    # backward (chunk_kda_fwd drops it).
    return (4 * w.W + w.H + 2 * w.H * w.C) * a + 3 * w.H * f


def _kda(w: Widths, T: int, a: int, f: int, ops: str, mode: str) -> float:
    """KDA sublayer (after its norm), per token."""
    pad = math.ceil(T / w.C) * w.C / T if ops == "torch" else 1.0
    core = _kda_core(w, T, a, f, ops)
    if mode == "selective":
        return core + w.W * a * pad          # the core's own saved tensors + its kept output
    # input (shared by 6 projections), q/k/v conv input and output, the gate's low rank,
    # beta; the output norm x sigmoid gate (o, rstd, normed, gate), o_proj input.
    if ops == "torch":
        return (w.D + 6 * w.W + w.K + w.H) * a + core + (w.W * pad + 3 * w.W + w.H) * f + w.W * a
    return (w.D + 3 * w.W + w.K + w.W) * a + core + (2 * w.W) * a + w.H * f + w.W * a


def _mla(w: Widths, T: int, a: int, f: int, ops: str, mode: str) -> float:
    """Gated MLA sublayer (after its norm), per token."""
    H = w.Hm
    if ops == "torch":   # SDPA math path: q and k copies, the [T] probabilities, v
        core = (2 * H * w.qk + H * T + H * w.v) * f
    else:                # flash attention: q, k, v, output and the fp32 log-sum-exp
        core = (2 * H * w.qk + 2 * H * w.v) * a + H * f
    if mode == "selective":
        return core + H * w.v * a
    lora = _norm(w.ql, a, f, ops) + w.ql * a + (w.kvl + w.rope) * a + _norm(w.kvl, a, f, ops) \
        - (w.kvl * f if _eager(ops) else w.kvl * a) + w.kvl * a
    # q_down input; low-rank norms and up-projection inputs; the core; gate, attn, o_proj input
    return w.D * a + lora + core + 3 * H * w.v * a


def mla_key_bytes_per_token(w: Widths, a: int, ops: str) -> float:
    """The key side of :func:`_mla`, per key token: what expanding one token's latent into keys
    and values keeps (the latent, kv_norm, kv_up's input, the attention's k and v). Under
    context parallelism a rank expands the gathered keys, not only its own tokens."""
    f = 4
    return (w.kvl + w.rope) * a + _norm(w.kvl, a, f, ops) - (w.kvl * f if _eager(ops) else w.kvl * a) \
        + w.kvl * a + w.Hm * (w.qk + w.v) * (f if ops == "torch" else a)


def kda_cp_bytes_per_token(w: Widths, n: int, a: int, ops: str) -> float:
    """What a KDA layer keeps per local token under context parallelism beyond :func:`_kda`'s,
    for pieces of ``n`` tokens (``k3train.ops.context_parallel.kda_local_states`` and
    ``kda_cp``): the kernel runs on values ``[v, 0]`` of width V + K, so each tensor it keeps
    at the values' width keeps K more columns per head; and the output correction
    ``o0 + q~ S`` keeps its GEMM's copy of ``q~`` ``[H, K]`` per token in fp32 (the correction
    runs outside autocast, ``context_parallel._fp32_einsum``). fla's chunk_kda keeps v (the only
    value-wide tensor it saves);
    chunk_kda_torch keeps three value-wide fp32 rows per token (the solve's right-hand side
    before and after it, and each chunk's delta) and one ``[K, V]`` state per chunk of C
    tokens, on whole chunks of each piece."""
    wide = w.H * w.K    # the K extra value columns of every head
    q_copy = wide * 4   # the correction's fp32 copy of q~
    if ops == "torch":
        pad = math.ceil(n / w.C) * w.C / n
        return q_copy + (3 * wide + wide * w.K / w.C) * 4 * pad
    return wide * a + q_copy


def _glu(n: int, a: int, ops: str) -> float:
    """SiTU-GLU of width n plus its down-projection input: eager keeps 6 tensors, compiled 2."""
    return (7 if _eager(ops) else 3) * n * a


def _dense(w: Widths, a: int, ops: str) -> float:
    return w.D * a + _glu(w.F, a, ops)


def _moe(w: Widths, a: int, f: int, ops: str) -> float:
    """LatentMoE (after its norm), per token: router (scores, top-k ids and weights), the
    permuted latent rows and the experts' GLU for k rows per token, the combine, the latent
    norm and up input, and the shared expert."""
    router = w.E * f + w.k * 8 + (1 + w.k) * f
    routed = w.k * w.L * a + w.k * 8 * 2 + _glu(w.Fe, a, ops) * w.k + w.k * f + w.k * w.L * a
    return w.D * a + router + routed + _norm(w.L, a, f, ops) + w.L * a + _glu(w.Fs, a, ops)


def _mix(S: int, w: Widths, a: int, f: int, ops: str) -> float:
    """One AttnRes depth mix over S sources: torch stacks them in fp32 and keeps the stack, its
    normalised copy and the weights; fla's kernel keeps the newest source (the partial sum;
    the blocks are stored once) and the fp32 weights."""
    if ops == "torch":
        return 2 * S * w.D * f + 2 * S * f
    return w.D * a + S * f


def layer_bytes_per_token(cfg: RunConfig, index: int, mode: str, ops: str, T: int, a: int) -> float:
    """Activation bytes layer ``index`` keeps per token under recompute ``mode``.

    a: bytes of an activation (4 in fp32, 2 under bf16 autocast); T: sequence length (the torch
    forms keep [T]-wide attention rows and pad KDA to whole chunks). Under ``full`` a layer keeps
    its input only: the hidden state or, with AttnRes, the block's partial sum (a layer that
    opens a block has none) plus the block it closes; the blocks it reads were counted where
    they were made."""
    w, f = Widths.of(cfg), 4
    m = cfg.model
    kind = expand_layer_pattern(m.layer_pattern, m.num_layers)[index]
    attnres = m.attnres.enabled
    bs = m.attnres.block_size
    # With AttnRes: the block's partial sum (none where the layer opens a block, except layer 0,
    # whose region keeps block 0, the embedding, made outside every layer) and the block it closes.
    inputs = w.D * a if not attnres else w.D * a * ((index % bs != 0 or index == 0) + ((index + 1) % bs == 0))
    if mode == "full":
        return inputs
    mixer = (_kda if kind == "K" else _mla)(w, T, a, f, ops, mode)
    if mode == "selective":
        return inputs + mixer
    moe = index >= m.dense_layers
    ffn = _moe(w, a, f, ops) if moe else _dense(w, a, ops)
    out = 2 * _norm(w.D, a, f, ops) + mixer + ffn
    if attnres:
        blocks = 1 + index // bs
        partial = index % bs != 0
        out += _mix(blocks + partial, w, a, f, ops) + _mix(blocks + 1, w, a, f, ops)
    return out


def recomputed_bytes_per_token(cfg: RunConfig, index: int, mode: str, ops: str, T: int, a: int) -> float:
    """Bytes per token live while layer ``index``'s region is recomputed in backward: its whole
    activations, less, under ``selective``, the cores' saved tensors and kept outputs, which are
    stored from the forward (counted in the mode's stored bytes) and not made again."""
    live = layer_bytes_per_token(cfg, index, "none", ops, T, a)
    if mode == "selective":
        live -= layer_bytes_per_token(cfg, index, "selective", ops, T, a) - layer_bytes_per_token(cfg, index, "full", ops, T, a)
    return live


def offload_bytes_per_token(cfg: RunConfig, index: int, mode: str, ops: str, T: int, a: int,
                            pieces: int | None = None) -> tuple[float, float]:
    """Under ``train.offload_activations`` (a layer is two regions, its mixer half and its FFN
    half, both in ``train.recompute_pieces`` token pieces): (bytes per token layer
    ``index`` keeps in host memory, bytes per token live on the device while its larger half is
    recomputed, that half's kept bytes copied back included). ``pieces``: the halves' pieces
    (default the config's; 1: whole halves).
    Host: the layer's kept bytes plus the mixer half's output, the FFN half's input."""
    w, f = Widths.of(cfg), 4
    m = cfg.model
    kind = expand_layer_pattern(m.layer_pattern, m.num_layers)[index]
    kept = layer_bytes_per_token(cfg, index, mode, ops, T, a)
    mixer = (_kda if kind == "K" else _mla)(w, T, a, f, ops, "none")
    ffn = _moe(w, a, f, ops) if index >= m.dense_layers else _dense(w, a, ops)
    # Each half's region inputs come back from the host for its recompute: the partial sum (or
    # hidden state) / the mixer half's output, and every block the half reads (a block is kept
    # once on the host, but each region that reads it copies it back).
    mix_a = mix_b = 0.0
    inputs_a = inputs_b = w.D * a
    if m.attnres.enabled:
        bs = m.attnres.block_size
        blocks, partial = 1 + index // bs, index % bs != 0
        mix_a, mix_b = _mix(blocks + partial, w, a, f, ops), _mix(blocks + 1, w, a, f, ops)
        inputs_a, inputs_b = (blocks + partial) * w.D * a, (blocks + 1) * w.D * a
    if mode == "selective":   # the cores are kept (and copied back), not recomputed
        cores = kept - layer_bytes_per_token(cfg, index, "full", ops, T, a)
        mixer -= cores
        inputs_a += cores
    half_a = _norm(w.D, a, f, ops) + mixer + mix_a + inputs_a
    half_b = _norm(w.D, a, f, ops) + ffn + mix_b + inputs_b
    pieces = cfg.train.recompute_pieces if pieces is None else pieces
    if pieces > 1:
        # train.recompute_pieces: the FFN half and the mixer half (not under CP, whose exchanges
        # own the sequence; recompute._piece_kind) recompute one token piece at a time; their
        # input gradients arrive per piece and are joined once the last piece is done (one whole
        # [T, D] per input, counted with the half: the measured backward factor then applies to
        # them too, which overcounts). A KDA piece's conv halo (W - 1 tokens) and the state it
        # hands over ([H, K, V] per row) do not grow with T. An MLA piece expands the latent of
        # its whole prefix (the last piece's: every token) into keys and values; the region
        # before the pieces makes the whole window's latent (depth mix, norm, kv_down).
        half_b = half_b / pieces + inputs_b
        if cfg.parallel.cp == 1 and kind == "K":
            half_a = half_a / pieces + inputs_a
        elif cfg.parallel.cp == 1:
            key = mla_key_bytes_per_token(w, a, ops)
            latent = _norm(w.D, a, f, ops) + mix_a + inputs_a + (w.kvl + w.rope) * a
            half_a = max((half_a - key - inputs_a) / pieces + key + inputs_a, latent)
    return kept + w.D * a, max(half_a, half_b)


def records_bytes_per_token(cfg: RunConfig, layers: list[int], a: int) -> float:
    """What the MoE layers among ``layers`` keep in their routing records per token of one
    microbatch, until the step ends (moe/routing_record.py, ``step``, cleared by the trainer
    after the optimizer step and the balancer): what the step's readers use of each training
    forward, the top-k ids as int32 (the load metrics) and, only under ``moe.balancing:
    quantile`` (``moe.balancing.reads_step_scores``), the scores ``[E]`` in the router's dtype
    (the activation dtype ``a``). Every microbatch of the step adds its own, pipelined or
    accumulated alike. Recompute does not drop them (the recomputed forward's record is
    discarded, the first one kept)."""
    w = Widths.of(cfg)
    moe = sum(1 for i in layers if i >= cfg.model.dense_layers)
    scores = w.E * a if reads_step_scores(cfg.moe.balancing) else 0
    return moe * (w.k * 4 + scores)


def records_shared_bytes_per_token(cfg: RunConfig, layers: list[int], mode: str, a: int) -> float:
    """Of ``records_bytes_per_token``, what autograd saves for the backward too (so the layers'
    activations count it already) until the microbatch's backward has run: under ``none`` the
    scores when the record keeps them (the sigmoid's saved output, the same tensor); not the
    ids (the record's int32 copy is its own tensor); nothing under ``selective``/``full``, which
    recompute the MoE layers and keep the first forward's routing in the record alone."""
    if mode != "none" or not reads_step_scores(cfg.moe.balancing):
        return 0.0
    w = Widths.of(cfg)
    moe = sum(1 for i in layers if i >= cfg.model.dense_layers)
    return moe * w.E * a


def routing_last_bytes_per_token(cfg: RunConfig, layers: list[int], a: int) -> float:
    """What the MoE layers among ``layers`` hold per token of ONE microbatch in their records'
    ``last`` (the last forward's whole ``RouterOutput``, kept for diagnostics and overwritten by
    each forward, so held all the time, across steps): the logits and the weights, the int64
    ids, and the scores when the step does not keep them already (``records_bytes_per_token``
    counts the same tensor then). A constant, not per microbatch."""
    w = Widths.of(cfg)
    moe = sum(1 for i in layers if i >= cfg.model.dense_layers)
    scores = 0 if reads_step_scores(cfg.moe.balancing) else w.E * a
    return moe * (w.E * a + w.k * a + w.k * 8 + scores)


def block_grads_bytes_per_token(cfg: RunConfig, index: int, a: int) -> float:
    """Gradients live in the backward of layer ``index`` besides its own: with AttnRes, one
    accumulator per block made before it (every later region's depth mix sends each block a
    gradient, summed in autograd's input buffer until the backward reaches the block's producing
    layer), plus the gradient of the layer's output; the residual stream's gradient otherwise."""
    D = cfg.model.hidden_size
    if not cfg.model.attnres.enabled:
        return D * a
    return (1 + index // cfg.model.attnres.block_size + 1) * D * a


# Measured, not derived: the backward of a recomputed half-layer region on CUDA (fla's chunk_kda
# and fused AttnRes backward, the MoE experts' backward) holds this many times the half's planned
# activations on top of them, from k3_mini at 262,144 tokens under full + offload on one H200
# (49.7 GiB peak, benchmarks/2026-12-04_h200_save-stall-fp8x-capacity.md) after every term the
# CPU measurement explains (tests/profiling/test_memory_plan_peak.py). Workspaces of GPU
# kernels and the autocast cache cannot be seen on CPU; see docs/memory.md.
FUSED_HALF_BACKWARD = 1.54


def head_bytes_per_token(cfg: RunConfig, mode: str, ops: str, a: int) -> float:
    """Embedding ids, the final depth mix (own region under recompute), norm, head input,
    fp32 log-softmax over the vocabulary and the targets."""
    w, f = Widths.of(cfg), 4
    m = cfg.model
    out = 8 + _norm(w.D, a, f, ops) + w.D * a + w.V * f + 8
    if m.attnres.enabled and mode == "none":
        S = 1 + m.num_layers // m.attnres.block_size + (m.num_layers % m.attnres.block_size != 0)
        out += _mix(S, w, a, f, ops)
    return out
