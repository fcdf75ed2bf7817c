"""Per-rank memory of a training layout, from formulas (``k3train model-info``; docs/memory.md).

Static part, counted on the meta-device model (``StateLayout``, bytes per parameter): weights
in ``precision.param_dtype`` (4 fp32, 2 bf16), one fp32 gradient (main_grad, 4), an fp32 main
copy (4) only under bf16 weights, and the optimizer's moments in ``optim.state_dtype`` (AdamW two,
Muon one momentum buffer; 4 or 2 bytes each). Under ZeRO-1 the main copy and the moments are
divided by the shard count: data parallel for dense weights, expert data parallel (dp/ep) for
the routed experts; weights and gradients are not. Under context parallelism the dp x cp
ranks share them (ZeRO-1 shards over DP x CP, the expert groups lie inside it). A rank holds its pipeline chunks' layers,
1/tp of the head-sharded weights and 1/ep of the routed experts.

Activations: bytes autograd keeps per token for each layer type (KDA, MLA, dense SiTU-GLU,
LatentMoE, AttnRes mixes), counted op by op from what each op saves for backward, for
``none``/``selective``/``full`` (``layer_bytes_per_token``). Two op sets:
* ``torch``: the pure-torch forms (CPU, and CUDA with ``kernels.backend=torch``): checked against
  the saved-tensor bytes measured on CPU (tests/profiling/test_memory_plan.py, within 15%);
* ``fused``: CUDA with fla's chunk_kda and fused AttnRes, compiled norms and SiTU-GLU and flash
  attention (bf16 activations); counted from the kernels' saved inputs, checked against
  ``torch.cuda.max_memory_allocated`` by benchmarks/bench_memory_plan.py.
Beside what autograd saves, a step holds two terms no op saves, found by tracking every live
tensor at the CPU allocator's peak (tests/profiling/test_memory_plan_peak.py: ``none``,
``selective``, ``full`` and ``full`` + offload each within 10% of the allocator; ``full`` 14%
under without them, offload 19%): in a layer's backward, the gradient accumulators of the
AttnRes blocks made below it plus the stream's gradient (``block_grads_bytes_per_token``); and
every MoE layer's routing record of every training forward of the step, which the trainer
keeps until the step ends (moe/routing_record.py: the balancer and the load metrics read the
whole step's routing after the optimizer step, then ``clear``): what they read, the top-k ids
(int32) per token and, under quantile balancing only, the scores ``[E]``
(``records_bytes_per_token``), every microbatch's, pipelined or accumulated alike. Under
``none`` the kept scores are saved for backward too until the microbatch's backward
(``records_shared_bytes_per_token``, not counted twice). Besides, each MoE layer's record holds
its last forward's whole routing (logits, scores, ids, weights of one microbatch, overwritten
by the next forward: ``routing_last`` in the plan, ``routing_last_bytes_per_token``), held
across steps like the weights (the CPU peak tests measure from a baseline that has it).

A rank's peak is found by replaying its schedule (interleaved 1F1B under PP, ``pipeline.
schedule``; forward, backward per microbatch without): a forward adds its chunk's kept
activations and records, a backward frees the activations only; during a chunk's forward and
backward its largest layer's recomputed activations (under ``selective``/``full``) and, in
backward, that layer's block gradients live beside what is held. Under PP a rank also holds the
AttnRes block cache: the blocks its later chunks read, one set per in-flight microbatch. MoE
dispatch buffers are the permuted tokens of one layer at capacity (transient, live during one
layer's forward/backward). A shortened replay (the layout search's) counts the records of the
step's left-out microbatches from its start (``step_microbatches``).

Context parallelism (``cp``, predicted: not yet measured on GPUs): each CP rank keeps the
activations of its ``seq_len / cp`` tokens, and on top of them what the exchanges leave
(docs/long_context.md), under the run's ``parallel.cp_partition``, counted for the rank whose
last piece ends the sequence (the last rank when contiguous, rank 0 under head-tail): per MLA
layer the key side of the layer's activations (``mla_key_bytes_per_token``: the latent,
kv_norm, kv_up's input, the attention's k and v) for each token the rank expands beyond its
own (the gathered latent up to the end of its last piece), under the pure-torch forms SDPA's
probabilities over those keys, on CUDA kernels the explicit mask's additive bias that SDPA's
fused kernel keeps (cuDNN attention on torch 2.11; flash attention takes no mask: measured for
SDPA alone on an H200, not yet inside the layer),
and under head-tail the int64 index that puts the gathered latent in sequence order; per KDA
layer the fold's fp32 states, per piece the rank holds (one, two under head-tail): its folded
initial state ``[H, K, V]`` and its transition, a view of the kernel's ``[H, K, V + K]`` end
state (rows with a document start keep a fresh ``[H, K, K]`` instead; the plan counts the rows
without one), fla's copy of the ``[H, K, V + K]`` seed, and per local token the kernel's
value-wide tensors K columns wider (it runs on ``[v, 0]``) and the output correction's copy of
``q~`` (``kda_cp_bytes_per_token``). ``cp_extra`` in the plan;
tests/profiling/test_memory_plan.py measures them on 2 CPU ranks (the fold to the byte, the
MLA and KDA layers within 15% and 10%), both partitions.

Offload (``train.offload_activations``, k3train/model/offload.py): under ``full`` and
``selective`` what the layers' regions keep moves to host memory (``host_offload`` in the plan,
the schedule's peak of it), and each layer is two regions (mixer half, FFN half), whose
boundary tensor is one more kept ``[T, D]`` per layer, on the host; the device keeps the head's
activations and, while a half is recomputed, that half's activations and its kept bytes copied
back (the larger half of any layer), beside the block gradients and the records above. On
CUDA kernels the half's backward holds ``FUSED_HALF_BACKWARD`` times its planned activations more (kernel workspaces:
fla's chunk_kda and fused AttnRes backward, the experts' grouped GEMMs), a factor measured once
on one H200 (k3_mini, 256K tokens), not derived: the CPU cannot see those workspaces.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3train.config import RunConfig
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.config.schema import RECOMPUTE_MODES as MODES
from k3train.config.schema import ParallelConfig
from k3train.errors import UsageError
from k3train.model.model import build_model
from k3train.ops.context_parallel import cp_pieces, num_pieces
from k3train.profiling.activation_bytes import (FUSED_HALF_BACKWARD, OPS, Widths, block_grads_bytes_per_token,
                                               head_bytes_per_token, kda_cp_bytes_per_token, layer_bytes_per_token,
                                               mla_key_bytes_per_token,
                                               offload_bytes_per_token, recomputed_bytes_per_token,
                                               records_bytes_per_token, records_shared_bytes_per_token,
                                               routing_last_bytes_per_token)
from k3train.trainer.optimizer import k3_param_rules
from optim import build_param_table
from pipeline import PipelineLayout
from pipeline.schedule import build_schedule

GiB = 1024 ** 3


def _schedule_peak(pp: int, vpp: int, m: int, rank: int, chunk_bytes: dict[int, float],
                   schedule: list | None = None, *, records: dict[int, float] | None = None,
                   forward: dict[int, float] | None = None, backward: dict[int, float] | None = None,
                   records_before: float = 0.0) -> tuple[float, int]:
    """(peak bytes, peak in-flight microbatches) of ``rank`` over its 1F1B schedule
    (``schedule``: that rank's ops when already built; pp = 1 is F, B per microbatch).

    chunk_bytes: what a chunk's forward keeps until its backward; records: what it keeps until
    the step ends (the routing records); forward / backward: bytes live beside those while the
    chunk's forward / backward runs (a layer's activations, recomputed ones and gradients);
    records_before: records of earlier microbatches of the step that the replay leaves out."""

    records, forward, backward = records or {}, forward or {}, backward or {}
    live, peak, peak_mbs, held, in_flight = records_before, records_before, 0, {}, 0
    for op in schedule if schedule is not None else build_schedule(pp, vpp, m, rank):
        c = op.chunk
        if op.kind == "F":
            peak = max(peak, live + forward.get(c, 0.0))
            live += chunk_bytes[c] + records.get(c, 0.0)
        else:
            peak = max(peak, live + backward.get(c, 0.0))
            live -= chunk_bytes[c]
        sign = 1 if op.kind == "F" else -1
        before = held.get(op.microbatch, 0)
        held[op.microbatch] = before + sign
        # microbatches with a forward still to be undone, counted as they come and go
        in_flight += (before + sign > 0) - (before > 0)
        if live > peak:
            peak = live
        if in_flight > peak_mbs:
            peak_mbs = in_flight
    return peak, peak_mbs


DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class StateLayout:
    """How a rank stores weights and optimizer state (the bytes-per-parameter contract).

    param_dtype: the weights' dtype (``precision.param_dtype``); bf16 adds an fp32 main copy.
    state_dtype: the moments' dtype (``optim.state_dtype``). zero1: main copy and moments
    sharded over data parallel (experts: expert data parallel)."""

    param_dtype: str = "fp32"
    state_dtype: str = "fp32"
    zero1: bool = False

    @classmethod
    def of(cls, cfg: RunConfig) -> "StateLayout":
        return cls(param_dtype=getattr(cfg.precision, "param_dtype", "fp32"),
                   state_dtype=getattr(cfg.optim, "state_dtype", "fp32"), zero1=cfg.optim.zero1)

    def __post_init__(self):
        for name in ("param_dtype", "state_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {getattr(self, name)!r}")


@dataclass
class ParamCounts:
    """Parameters one rank holds (after tp and ep), by optimizer: dense (sharded over dp under
    ZeRO-1) and routed experts (over dp/ep). ``*_muon``: matrices Muon updates (one momentum
    buffer); ``*_adamw``: the rest, or everything under AdamW (two moments)."""

    dense_muon: float = 0.0
    dense_adamw: float = 0.0
    expert_muon: float = 0.0
    expert_adamw: float = 0.0

    @property
    def dense(self) -> float:
        return self.dense_muon + self.dense_adamw

    @property
    def expert(self) -> float:
        return self.expert_muon + self.expert_adamw

    @property
    def total(self) -> float:
        return self.dense + self.expert

    def static_bytes(self, state: StateLayout, dp: int, edp: int) -> dict[str, float]:
        """{params, grads, master, optimizer} bytes of this rank under ``state`` with ``dp``
        data-parallel and ``edp`` expert-data-parallel replicas (the ZeRO-1 shard counts)."""
        s = DTYPE_BYTES[state.state_dtype]
        dz, ez = (dp, edp) if state.zero1 else (1, 1)
        master = 4.0 * (self.dense / dz + self.expert / ez) if state.param_dtype == "bf16" else 0.0
        optimizer = s * ((self.dense_muon + 2 * self.dense_adamw) / dz + (self.expert_muon + 2 * self.expert_adamw) / ez)
        return {"params": DTYPE_BYTES[state.param_dtype] * self.total, "grads": 4.0 * self.total,
                "master": master, "optimizer": optimizer}


@dataclass
class RankPlan:
    """Bytes of one pipeline rank (every DP/TP/EP rank of a stage holds the same). The static
    fields are those of ``state`` (the config's StateLayout); ``static(state)`` gives any other.
    ``optimizer``/``master``: unsharded; ``*_zero1``: under ZeRO-1 at the plan's dp and ep."""

    pp_rank: int
    layers: list[int]
    params: float
    grads: float
    optimizer: float
    optimizer_zero1: float
    master: float = 0.0
    master_zero1: float = 0.0
    counts: ParamCounts = field(default_factory=ParamCounts)
    dp: int = 1
    edp: int = 1
    activations: dict[str, float] = field(default_factory=dict)   # per microbatch, per mode
    peak_activations: dict[str, float] = field(default_factory=dict)  # schedule peak, per mode
    in_flight: int = 1
    cp: int = 1
    attnres_cache: float = 0.0
    moe_buffers: float = 0.0
    routing_last: float = 0.0     # the MoE records' last forward (one microbatch), held always
    cp_extra: dict[str, float] = field(default_factory=dict)       # context parallelism, per mode
    host_offload: dict[str, float] = field(default_factory=dict)   # train.offload_activations: host bytes, per mode

    def static(self, state: StateLayout) -> dict[str, float]:
        """{params, grads, master, optimizer} bytes under ``state`` (ParamCounts.static_bytes)."""
        return self.counts.static_bytes(state, self.dp, self.edp)

    def total(self, mode: str, zero1: bool, state: StateLayout | None = None) -> float:
        """Bytes of the rank at its peak under recompute ``mode``: weights, gradients, main copy
        and moments (the plan's dtypes, or ``state``'s; ``zero1`` decides the sharding unless
        ``state`` is given), activations, caches and buffers."""
        if state is None:
            static = (self.params + self.grads + (self.master_zero1 if zero1 else self.master)
                      + (self.optimizer_zero1 if zero1 else self.optimizer))
        else:
            static = sum(self.static(state).values())
        return (static + self.peak_activations[mode] + self.attnres_cache + self.moe_buffers
                + self.routing_last + self.cp_extra.get(mode, 0.0))


_SPLITS: dict[str, tuple[dict[int, dict[str, int]], dict[str, int]]] = {}


def _param_split(cfg: RunConfig) -> tuple[dict[int, dict[str, int]], dict[str, int]]:
    """Meta-device counts: per layer {muon, adamw, expert, expert_opt} and the embedding/head.
    Whole (unsharded) counts, built at the default parallel layout and kept per model, MoE and
    optimizer (a layout search plans the same model many times)."""
    key = cfg.model.model_dump_json() + cfg.moe.model_dump_json() + cfg.optim.name
    if key not in _SPLITS:
        _SPLITS[key] = _count_split(cfg.model_copy(update={"parallel": ParallelConfig()}))
    return _SPLITS[key]


def _count_split(cfg: RunConfig) -> tuple[dict[int, dict[str, int]], dict[str, int]]:
    with torch.device("meta"):
        model = build_model(cfg)
    rules = k3_param_rules(model, per_head=False)
    table = build_param_table(model.named_parameters(), rules)
    per_layer: dict[int, dict[str, int]] = {}
    # outside the layers: the embedding (first chunk) and the final mix, norm and head (last chunk)
    outer = {"muon": 0, "adamw": 0, "first_muon": 0, "first_adamw": 0}
    for e in table:
        opt = e.optimizer if cfg.optim.name == "muon" else "adamw"
        n = e.param.numel()
        if e.name.startswith("layers."):
            i = int(e.name.split(".")[1])
            d = per_layer.setdefault(i, {"muon": 0, "adamw": 0, "expert": 0, "expert_opt": opt})
            if ".ffn.experts." in e.name:
                d["expert"] += n
                d["expert_opt"] = opt
            else:
                d[opt] += n
        else:
            outer[opt] += n
            if e.name.startswith("embed."):
                outer["first_" + opt] += n
    return per_layer, outer


def kda_fold_state_bytes(cfg: RunConfig, cp: int, partition: str | None = None) -> float:
    """The fp32 states one KDA layer's CP fold keeps for backward on every CP rank, whatever
    the length: per piece the rank holds (one, two under head-tail) and row of the microbatch,
    ``_KdaStateExchange``'s folded initial state S_p ``[H, K, V]`` and M, a view of the
    kernel's ``[E, M]`` end state, whose storage ``[H, K, V + K]`` stays. Under document
    masking KimiDeltaAttention folds row by row, and a row with a document start in the rank's
    share stacks its M into a fresh ``[H, K, K]`` (K (V + K) per piece and head, a third less);
    a row without one (a document longer than the share: the long-context case) keeps the wide
    storage, so this counts every row so. 0 at ``cp`` = 1."""
    if cp == 1:
        return 0.0
    partition = cfg.parallel.cp_partition if partition is None else partition
    w = Widths.of(cfg)
    V = w.K
    return len(cp_pieces(0, cp, partition)) * cfg.train.micro_batch_size * w.H * w.K * ((V + w.K) + V) * 4


def cp_extra_bytes(cfg: RunConfig, layers: list[int], act_bytes: int, cp: int,
                   partition: str | None = None, *, ops: str = "fused") -> float:
    """Bytes one microbatch's forward keeps on the heaviest CP rank for the CP exchanges of
    ``layers`` (module docstring), beyond its own tokens' activations; 0 at ``cp`` = 1.
    partition: ``contiguous`` or ``head_tail`` (default ``parallel.cp_partition``); ops as
    :func:`plan_memory`'s (``torch``: SDPA's math path keeps the probabilities; ``fused``:
    SDPA's fused kernel keeps the mask as an additive bias)."""
    if cp == 1:
        return 0.0
    partition = cfg.parallel.cp_partition if partition is None else partition
    w = Widths.of(cfg)
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    a, f, H = act_bytes, 4, w.Hm
    mla = sum(1 for i in layers if kinds[i] == "M")
    kda = sum(1 for i in layers if kinds[i] == "K")
    # MLA expands the gathered latent up to the end of the rank's last piece: the whole sequence
    # on the heaviest rank under either partition (contiguous: the last rank; head-tail: rank 0,
    # whose second piece is the sequence's last). Without CP the rank expands its own T tokens,
    # so the extra is the key side of the layer's per-token activations (activation_bytes._mla:
    # the latent, kv_norm, kv_up's input, the attention's k and v) for the keys - T others.
    # Under SDPA's math path (ops=torch) each of the rank's queries also keeps one probability
    # per key it sees (piece p's n queries see (p + 1) n keys, against T keys without CP).
    # Head-tail puts the gathered latent in sequence order with an index_select, which keeps its
    # int64 index [S] for backward.
    L = num_pieces(cp, partition)
    n = S // L
    heavy = max(range(cp), key=lambda r: max(cp_pieces(r, cp, partition)))
    pieces = cp_pieces(heavy, cp, partition)
    T, keys = len(pieces) * n, (max(pieces) + 1) * n
    kv_side = mla_key_bytes_per_token(w, a, ops)
    # The math path also copies each shorter prefix's keys and values it gets as a strided slice.
    probs = (H * (sum(n * (p + 1) * n for p in pieces) - T * T) * f
             + sum((p + 1) * n for p in pieces if p != max(pieces)) * H * (w.qk + w.v) * f) if ops == "torch" else 0
    # On CUDA the CP attention passes an explicit mask (causal at the queries' global positions,
    # and within documents under document masking), which rules flash attention out: SDPA runs
    # it in a fused kernel (cuDNN attention on torch 2.11) that keeps the boolean mask turned
    # into an additive bias in the activation dtype for backward, broadcast over heads (measured
    # for SDPA alone on an H200: [8K, 16K] kept 256 MiB, the bool not kept; not yet inside the
    # layer). Per piece p, [n, (p + 1) n] (mla_attention_cp: one call per piece, the batch
    # broadcast); under document masking one [B, T, keys] for the rank's queries
    # (MultiHeadLatentAttention._documents_cp). The math path (ops=torch) adds the mask to its
    # scores and keeps none.
    if ops == "torch":
        mask = 0
    elif cfg.data.masks_documents:
        mask = B * T * keys * a
    else:
        mask = sum(n * (p + 1) * n for p in pieces) * a
    order = 0 if partition == "contiguous" else S * 8
    expanded = B * ((keys - T) * kv_side + probs)
    # KDA: the fold's states (kda_fold_state_bytes; the same on every rank) and, per local
    # token, what running the kernel on [v, 0] and correcting its output keep more
    # (kda_cp_bytes_per_token, pieces of n tokens). Under ops=fused fla's kernel also keeps its
    # initial state, the [0, I] seed [H, K, V + K] fp32 per piece and row (chunk_kda_torch
    # folds it into its first chunk's state, counted per token).
    seed = 0 if ops == "torch" else len(pieces) * B * w.H * w.K * (w.K + w.K) * 4
    local = kda_fold_state_bytes(cfg, cp, partition) + seed + B * T * kda_cp_bytes_per_token(w, n, a, ops)
    return mla * (expanded + order + mask) + kda * local


def plan_memory(cfg: RunConfig, *, ops: str = "fused", act_bytes: int = 2, dp: int = 1,
                cp: int | None = None, state: StateLayout | None = None,
                step_microbatches: int | None = None) -> list[RankPlan]:
    """Memory of each pipeline rank of ``cfg.parallel`` (tp, pp, vpp, ep) with ``dp`` data-parallel
    replicas per stage (ep divides dp). ops: ``fused`` (CUDA kernels, compiled norms and SiTU-GLU),
    ``fused-eager`` (the same with ``kernels.compile=false``) or ``torch``; act_bytes: 2
    under bf16 autocast, 4 in fp32. Activations are per ``train.micro_batch_size x seq_len / cp``
    tokens; cp: context-parallel ranks (default ``parallel.cp``), which divide ``seq_len`` (so do
    the 2 cp pieces of ``parallel.cp_partition=head_tail``, whose exchanges ``cp_extra_bytes`` counts);
    state: weight and optimizer-state dtypes (default: the config's, ``StateLayout.of``);
    step_microbatches: microbatches of the step, whose routing records all live until it ends,
    when the schedule replayed (``train.microbatches``) is a shortened one (the layout search's).
    """

    if ops not in OPS:
        raise ValueError(f"ops must be one of {', '.join(OPS)}, got {ops!r}")
    p = cfg.parallel
    cp = getattr(p, "cp", 1) if cp is None else cp
    if cp < 1 or cfg.train.seq_len % cp:
        raise ValueError(f"context parallelism over {cp} ranks needs a train.seq_len divisible by it "
                         f"(got {cfg.train.seq_len})")
    if cp > 1 and cfg.train.seq_len % num_pieces(cp, p.cp_partition):
        raise ValueError(f"parallel.cp_partition={p.cp_partition} over {cp} ranks needs a train.seq_len "
                         f"divisible by {num_pieces(cp, p.cp_partition)} (got {cfg.train.seq_len})")
    # The ranks holding copies of the dense weights: ZeRO-1 shards their state over DP x CP,
    # and the expert groups lie inside them (megatron-core's layout).
    copies = dp * cp
    if copies % p.ep:
        raise ValueError(f"parallel.ep={p.ep} must divide the data-parallel size {dp}"
                         + (f" x parallel.cp={cp}" if cp > 1 else "") + " (EP runs inside DP x CP)")
    T = cfg.train.seq_len // cp
    tokens = cfg.train.micro_batch_size * T
    per_layer, outer = _param_split(cfg)
    layout = PipelineLayout(cfg.model.num_layers, p.pp, p.vpp)
    C = layout.num_chunks
    edp = copies // p.ep
    state = StateLayout.of(cfg) if state is None else state
    plans = []
    w = Widths.of(cfg)
    offload = cfg.train.offload_activations
    for r in range(p.pp):
        chunks = layout.chunks_of_rank(r)
        layers = [i for c in chunks for i in layout.layer_range(c)]
        n = ParamCounts()
        for i in layers:
            d = per_layer[i]
            n.dense_muon += d["muon"] / p.tp
            n.dense_adamw += d["adamw"] / p.tp
            if d["expert_opt"] == "muon":
                n.expert_muon += d["expert"] / p.ep
            else:
                n.expert_adamw += d["expert"] / p.ep
        # the embedding on the first chunk, the final mix, norm and head on the last
        for opt in ("muon", "adamw"):
            first = outer["first_" + opt]
            held = (first if 0 in chunks else 0) + (outer[opt] - first if C - 1 in chunks else 0)
            setattr(n, "dense_" + opt, getattr(n, "dense_" + opt) + held)
        full = n.static_bytes(StateLayout(state.param_dtype, state.state_dtype, False), copies, edp)
        z1 = n.static_bytes(StateLayout(state.param_dtype, state.state_dtype, True), copies, edp)
        plan = RankPlan(pp_rank=r, layers=layers, params=full["params"], grads=full["grads"],
                        optimizer=full["optimizer"], optimizer_zero1=z1["optimizer"], master=full["master"],
                        master_zero1=z1["master"], counts=n, dp=copies, edp=edp, cp=cp)
        m_step = cfg.train.microbatches if step_microbatches is None else step_microbatches
        schedule = build_schedule(p.pp, p.vpp, cfg.train.microbatches, r)
        for mode in MODES:
            per_chunk, host, records, shared, forward, backward = {}, {}, {}, {}, {}, {}
            for c in chunks:
                lay = list(layout.layer_range(c))
                b = sum(layer_bytes_per_token(cfg, i, mode, ops, T, act_bytes) for i in lay)
                # The routing records stay until the step ends, every microbatch's; under
                # ``none`` part of them is saved for backward too, counted in the layers.
                records[c] = records_bytes_per_token(cfg, lay, act_bytes) * tokens
                shared[c] = records_shared_bytes_per_token(cfg, lay, mode, act_bytes) * tokens
                # under offload: (host bytes, the larger half's device bytes) per layer
                off = ({i: offload_bytes_per_token(cfg, i, mode, ops, T, act_bytes) for i in lay}
                       if offload and mode != "none" else None)
                if off is not None:   # what the layers' regions keep is in host memory
                    host[c] = sum(off[i][0] for i in lay) * tokens
                    b = 0.0
                if c == C - 1:
                    b += head_bytes_per_token(cfg, mode, ops, act_bytes)
                per_chunk[c] = b * tokens - shared[c]
                # Beside what is held: the gradients of the AttnRes blocks made below a layer and
                # of the stream (block_grads) in its backward, and under recompute the layer's
                # activations made again (under offload, one half-layer region at a time with its
                # kept bytes copied back; on CUDA kernels times the measured backward factor).
                grads = {i: block_grads_bytes_per_token(cfg, i, act_bytes) for i in lay}
                # extra: what the CUDA kernels' backward holds beyond the plan under offload,
                # calibrated as FUSED_HALF_BACKWARD times the whole larger half. It stays that of
                # the whole half under train.recompute_pieces: on one H200 the pieces cut the
                # measured peak by 1% (k3_mini, 256K), so the excess is not the FFN half's.
                extra = {i: 0.0 for i in lay}
                if mode == "none":
                    again = {i: 0.0 for i in lay}
                elif offload:
                    again = {i: off[i][1] for i in lay}
                    if ops != "torch":
                        whole = again if cfg.train.recompute_pieces == 1 else \
                            {i: offload_bytes_per_token(cfg, i, mode, ops, T, act_bytes, pieces=1)[1] for i in lay}
                        extra = {i: FUSED_HALF_BACKWARD * whole[i] for i in lay}
                else:
                    again = {i: recomputed_bytes_per_token(cfg, i, mode, ops, T, act_bytes) for i in lay}
                forward[c] = max(again.values()) * tokens
                backward[c] = max(again[i] + extra[i] + grads[i] for i in lay) * tokens
            if host:
                plan.host_offload[mode] = _schedule_peak(p.pp, p.vpp, cfg.train.microbatches, r, host, schedule)[0]
            plan.activations[mode] = sum(per_chunk.values()) + sum(shared.values())   # saved for backward
            # Microbatches the replay leaves out (the layout search replays a shortened
            # schedule) ran before it: their records are live from its start.
            before = sum(records.values()) * (m_step - cfg.train.microbatches)
            plan.peak_activations[mode], plan.in_flight = _schedule_peak(
                p.pp, p.vpp, cfg.train.microbatches, r, per_chunk, schedule, records=records,
                forward=forward, backward=backward, records_before=before)
        if cfg.model.attnres.enabled and C > 1:
            # Blocks a later local chunk reads: every block made before the rank's last chunk.
            last = max(chunks)
            first_layer = layout.layer_range(last).start
            blocks = 1 + first_layer // cfg.model.attnres.block_size
            plan.attnres_cache = blocks * tokens * w.D * act_bytes * plan.in_flight
        # none and selective keep every layer's exchange (the attention core, kept under
        # selective, saves the expanded keys and values); full recomputes them, one layer live.
        every = cp_extra_bytes(cfg, layers, act_bytes, cp, ops=ops) * plan.in_flight
        one = max((cp_extra_bytes(cfg, [i], act_bytes, cp, ops=ops) for i in layers), default=0.0)
        plan.cp_extra = {"none": every, "selective": every, "full": every and one}
        if any(i >= cfg.model.dense_layers for i in layers):
            cf = cfg.moe.capacity_factor
            # Under train.recompute_pieces (with offload) a training forward of the MoE runs one
            # token piece at a time: its buffers and its last routing record are a piece's.
            pieces = cfg.train.recompute_pieces if offload else 1
            rows = tokens / pieces * w.k * (cf if cf else 1.0)
            # permuted input, expert output, and under EP the all-to-all send and receive copies
            plan.moe_buffers = rows * w.L * act_bytes * (2 + (2 if p.ep > 1 else 0))
            plan.routing_last = routing_last_bytes_per_token(cfg, layers, act_bytes) * tokens / pieces
        plans.append(plan)
    return plans


def format_plan(cfg: RunConfig, plans: list[RankPlan], *, dp: int, ops: str) -> str:
    """The planner's table: one row per pipeline rank, the largest first."""
    p = cfg.parallel
    st = StateLayout.of(cfg)
    g = lambda b: f"{b / GiB:9.2f}"  # noqa: E731
    cp = plans[0].cp if plans else 1
    lines = [f"per-rank memory (GiB), tp={p.tp} pp={p.pp} vpp={p.vpp} ep={p.ep} dp={dp}"
             + (f" cp={cp} (predicted)" if cp > 1 else "") + ", "
             f"microbatch {cfg.train.micro_batch_size} x {cfg.train.seq_len} tokens"
             + (f" ({cfg.train.seq_len // cp} per CP rank)" if cp > 1 else "") + ", "
             f"{cfg.train.microbatches} microbatches, kernels={ops}:",
             f"{'pp rank':>8}{'layers':>8}{'params':>9}{'grads':>9}{'master':>9}{'mstr z1':>9}{'optim':>9}{'optim z1':>9}"
             + "".join(f"{'act ' + m:>14}" for m in MODES) + f"{'in-flight':>10}{'AR cache':>9}{'MoE buf':>9}"]
    order = sorted(plans, key=lambda q: -q.total("none", False))
    shown = order[:4] if len(plans) > 4 else plans
    for q in shown:
        lines.append(f"{q.pp_rank:>8}{len(q.layers):>8}{g(q.params)}{g(q.grads)}{g(q.master)}{g(q.master_zero1)}{g(q.optimizer)}"
                     f"{g(q.optimizer_zero1)}" + "".join(f"{q.peak_activations[m] / GiB:14.2f}" for m in MODES)
                     + f"{q.in_flight:>10}{g(q.attnres_cache)}{g(q.moe_buffers + q.routing_last)}")
    if len(plans) > len(shown):
        lines.append(f"  ({len(plans) - len(shown)} lighter pp ranks not shown)")
    top = {(m, z): max(q.total(m, z) for q in plans) / GiB for m in MODES for z in (False, True)}
    if any(q.host_offload for q in plans):
        lines.append("in pinned host memory (train.offload_activations), heaviest rank: "
                     + ", ".join(f"{m}: {max(q.host_offload[m] for q in plans) / GiB:.2f} GiB"
                                 for m in MODES if m in plans[0].host_offload)
                     + "; not in the totals below"
                     + ("" if ops == "torch" else
                        f"; the device's activations include {FUSED_HALF_BACKWARD:.2f} x the recomputed half's "
                        "for the CUDA kernels' backward (measured on one H200, docs/memory.md)"))
    if cp > 1:
        lines.append("CP exchanges kept (gathered MLA latent and expanded keys/values, KDA fold states), "
                     f"heaviest CP rank ({cfg.parallel.cp_partition}): "
                     + ", ".join(f"{m}: {max(q.cp_extra[m] for q in plans) / GiB:.2f} GiB" for m in MODES))
    lines.append("heaviest rank's total (params + grads + main copy + optimizer + peak activations + cache + MoE buffers and last routing"
                 + (" + CP exchanges" if cp > 1 else "") + "):")
    lines.append("  " + ", ".join(f"{m}: {top[(m, False)]:.1f} GiB ({top[(m, True)]:.1f} with ZeRO-1)" for m in MODES))
    lines.append("  activations are the schedule's peak over in-flight microbatches (1F1B warmup depth), with the step's routing records; "
                 f"{st.param_dtype} weights{' + fp32 main copy' if st.param_dtype == 'bf16' else ''}, fp32 gradients, "
                 f"{cfg.optim.name} state in {st.state_dtype}; see docs/memory.md")
    return "\n".join(lines)


def memory_report(cfg: RunConfig, dp: int = 1, cp: int | None = None) -> str:
    """``model-info``'s memory section for ``cfg.parallel`` with ``dp`` replicas per stage: the
    CUDA kernels at bf16 (fp32 under precision.recipe=fp32), or the torch forms in fp32 when
    ``train.device=cpu``."""

    cp_size = cfg.parallel.cp if cp is None else cp
    if dp < 1 or (dp * cp_size) % cfg.parallel.ep:
        if cp_size == 1:
            raise UsageError(f"--dp must be a positive multiple of parallel.ep={cfg.parallel.ep} "
                             f"(expert parallelism runs inside data parallelism), got {dp}")
        raise UsageError(f"--dp x --cp must be a positive multiple of parallel.ep={cfg.parallel.ep} "
                         f"(expert parallelism runs inside data x context parallelism), got {dp} x {cp_size}")
    cpu = cfg.train.device == "cpu"
    ops = "torch" if cpu else "fused-eager" if cfg.kernels.compile is False else "fused"
    act = 4 if cpu or cfg.precision.recipe == "fp32" else 2
    try:
        plans = plan_memory(cfg, ops=ops, act_bytes=act, dp=dp, cp=cp)
    except ValueError as exc:   # a layout the pipeline cannot run (layers, microbatches)
        raise UsageError(f"memory plan: {exc}") from None
    return format_plan(cfg, plans, dp=dp, ops=ops)
