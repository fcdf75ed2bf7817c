"""Which combinations of otherwise valid fields a run refuses, and why: the layout rules checked
when a config loads (one line naming the field, what is wrong and what is allowed) and the one
list of what rules out ``train.cuda_graph``. The fields themselves are in ``schema.py``; rules
that need the world size are in ``k3train.runtime.distributed.check_layout``."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # schema.py calls these from RunConfig's validator
    from k3train.config.schema import RunConfig


# Below this window (tokens), MLA masks documents with one SDPA call and the dense
# block-diagonal mask, built on the device from cu_seqlens (k3train.ops.documents), and the
# KDA and conv kernels take fixed-shape chunk lists built on the device: nothing is read on the
# host, so a CUDA-graphed step records document masking. From this window up, each document
# attends one causal call (only sum L_i^2 scores, no mask): at 32K the dense mask is 1 GiB per
# row and SDPA's masked kernel scored every pair of it (H200: masked training at 32K ran at
# 0.57x unmasked with the mask, 0.93x with a call per document, 2026-12-04). That path reads
# the boundaries on the host, so such steps are not graphed.
PER_DOCUMENT_MIN_WINDOW = 16384


def cuda_graph_blockers(cfg: RunConfig, *, device: str | None = None, auto: bool = False) -> dict[str, str]:
    """What rules out ``train.cuda_graph``: setting -> one line saying why, empty when
    nothing does; ``auto``: what keeps ``train.cuda_graph=auto`` off (those, plus paths that
    ``true`` may opt into before they are validated on a GPU). The one list of graph
    blockers: the load-time check refuses ``cuda_graph: true`` with the first, ``k3train.trainer.state.use_cuda_graph`` asks again
    with what only the run knows, ``device`` (the resolved device type). Pipeline
    parallelism replays chunk graphs, data parallelism reduces after the replay, and every
    precision recipe's scaling is computed inside the captured step (no state kept between
    steps), so none of them rules the graph out; Transformer Engine's modules
    (``precision.fp8_backend=te``) are not validated under capture and do."""
    out: dict[str, str] = {}
    p = cfg.parallel
    if p.cp != 1:
        out["parallel.cp"] = (f"train.cuda_graph is not wired with parallel.cp={p.cp} (the CP exchanges "
                              f"are not captured); it needs parallel.cp=1")
    if p.tp != 1:
        out["parallel.tp"] = (f"train.cuda_graph cannot capture parallel.tp={p.tp} (megatron-core's "
                              f"tensor-parallel linears run their collectives eagerly); it needs parallel.tp=1")
    if p.ep != 1 and cfg.moe.capacity_factor is None:
        # The static dispatcher (fixed capacity, fixed all-to-all splits) reads nothing on the
        # host: its all-to-all is recorded in the graph (benchmarks/bench_moe_permute.py --check).
        out["parallel.ep"] = (f"train.cuda_graph cannot capture parallel.ep={p.ep} with the dynamic "
                              f"dispatcher (it reads its all-to-all split sizes on the host); set "
                              f"moe.capacity_factor (the static dispatcher) or parallel.ep=1")
    dev = device if device is not None else cfg.train.device
    if dev not in ("cuda", "auto"):
        out["train.device"] = (f"train.cuda_graph needs a CUDA device, this run is on {dev} "
                               f"(train.device={cfg.train.device})")
    if cfg.precision.recipe == "fp8" and cfg.precision.fp8_backend == "te":
        out["precision.fp8_backend"] = ("train.cuda_graph is not validated with Transformer Engine's "
                                        "modules (precision.fp8_backend=te); use fp8_backend=torchao")
    if cfg.train.offload_activations:
        out["train.offload_activations"] = ("train.cuda_graph cannot capture the host copies of "
                                            "train.offload_activations=true")
    if cfg.data.masks_documents and cfg.train.seq_len >= PER_DOCUMENT_MIN_WINDOW:
        out["data.document_mask"] = (f"train.cuda_graph cannot capture document masking at train.seq_len="
                                     f"{cfg.train.seq_len}: from {PER_DOCUMENT_MIN_WINDOW} tokens MLA attends "
                                     f"one call per document, reading the boundaries on the host; it needs "
                                     f"train.seq_len < {PER_DOCUMENT_MIN_WINDOW} or data.document_mask=false")
    # Below 16K, graphed document masking trained on an H200 as eagerly (2026-12-04: the whole
    # step, scripts/gpu_check_graphed_documents.py; the chunk graphs, bench_chunk_graphs --mask),
    # so auto turns it on; no path is waiting for its first GPU run now.
    if cfg.precision.param_dtype != "fp32":
        out["precision.param_dtype"] = (f"train.cuda_graph cannot capture precision.param_dtype="
                                        f"{cfg.precision.param_dtype} (its fp32 gradient accumulation "
                                        f"runs in per-parameter hooks); it needs precision.param_dtype=fp32")
    return out


def cuda_graph_refusal(cfg: RunConfig, *, device: str | None = None) -> str | None:
    """Why ``train.cuda_graph: true`` cannot run (the first blocker, one line), or None."""
    blockers = cuda_graph_blockers(cfg, device=device)
    if not blockers:
        return None
    return f"{next(iter(blockers.values()))}; set train.cuda_graph=false (or auto)"


def _cp_refusal(cfg: RunConfig) -> str | None:
    """The first rule a ``parallel.cp > 1`` config breaks (one line), or None. Context
    parallelism is wired with DP, PP (any vpp), EP, TP, ZeRO-1, Muon and every balancer
    (docs/long_context.md, "what is built")."""
    p, t = cfg.parallel, cfg.train
    if t.cuda_graph is True:
        return (f"parallel.cp={p.cp} with train.cuda_graph=true: not wired yet (context parallelism "
                f"runs with every other layout but not CUDA graphs); change train.cuda_graph or use "
                f"parallel.cp=1")
    if t.seq_len % p.cp:
        return (f"train.seq_len={t.seq_len} is not divisible by parallel.cp={p.cp} (each CP rank "
                f"holds seq_len/cp contiguous tokens); use a multiple of {p.cp}")
    pieces = p.cp if p.cp_partition == "contiguous" else 2 * p.cp
    if t.seq_len % pieces:
        return (f"train.seq_len={t.seq_len} is not divisible by 2 * parallel.cp={pieces} under "
                f"parallel.cp_partition=head_tail (2*cp equal pieces); use a multiple of {pieces} "
                f"or parallel.cp_partition=contiguous")
    halo = cfg.model.kda.conv_size - 1
    if t.seq_len // pieces < max(halo, 1):
        where = "rank" if p.cp_partition == "contiguous" else "head_tail piece"
        return (f"train.seq_len={t.seq_len} over parallel.cp={p.cp} leaves {t.seq_len // pieces} tokens "
                f"per {where}, fewer than the {halo} the short convolution's halo needs; use a longer "
                f"seq_len or a smaller cp")
    return None


def layout_refusal(cfg: RunConfig) -> str | None:
    """The first layout rule this config breaks, as one line naming the field, what is
    wrong and what is allowed; None when the layout is valid. Rules that need the world
    size stay in ``k3train.runtime.distributed.check_layout``."""
    p, moe = cfg.parallel, cfg.moe
    if p.cp > 1:
        refusal = _cp_refusal(cfg)
        if refusal is not None:
            return refusal
    if p.vpp > 1 and p.pp == 1:
        return (f"parallel.vpp={p.vpp} needs parallel.pp > 1 (virtual stages interleave over "
                f"pipeline ranks); set parallel.vpp=1 or parallel.pp >= 2")
    chunks = p.pp * p.vpp
    if cfg.model.num_layers < chunks:  # pipeline/layout.py gives every chunk at least one layer
        return (f"model.num_layers={cfg.model.num_layers} cannot be split over parallel.pp={p.pp} x "
                f"parallel.vpp={p.vpp} = {chunks} pipeline chunks (each needs at least one layer); "
                f"use at least {chunks} layers or a smaller pp/vpp")
    m = cfg.train.microbatches
    if p.vpp > 1 and (m < p.pp or m % p.pp):
        return (f"train.microbatches={m} cannot run the interleaved schedule of parallel.pp={p.pp} "
                f"x parallel.vpp={p.vpp} (chunks would wait on each other); use a multiple of "
                f"{p.pp}, at least {p.pp}, or parallel.vpp=1")
    if cfg.model.tie_embeddings and p.pp > 1:
        return (f"model.tie_embeddings=true needs the embedding and the head on one pipeline rank "
                f"(got parallel.pp={p.pp}); set model.tie_embeddings=false or parallel.pp=1")
    if p.ep > 1 and p.tp > 1:
        return (f"parallel.ep={p.ep} together with parallel.tp={p.tp} is not supported yet (experts "
                f"would need expert-tensor-parallel groups); use parallel.tp=1 with ep, or ep=1")
    has_moe = cfg.model.dense_layers < cfg.model.num_layers
    if has_moe and moe.num_experts % p.ep:
        return (f"moe.num_experts={moe.num_experts} is not divisible by parallel.ep={p.ep} (each "
                f"expert-parallel rank holds num_experts/ep experts); use an ep that divides it")
    if moe.dispatcher == "local" and p.ep > 1:
        return (f"moe.dispatcher=local cannot run with parallel.ep={p.ep} (it exchanges no tokens); "
                "use moe.dispatcher=grouped_a2a or auto")
    if moe.dispatcher == "local" and moe.capacity_factor is not None:
        return (f"moe.capacity_factor={moe.capacity_factor} needs moe.dispatcher=grouped_a2a or auto "
                "(local never drops); unset it or change the dispatcher")
    if cfg.train.recompute_pieces > 1:
        refusal = _pieces_refusal(cfg)
        if refusal is not None:
            return refusal
    if cfg.train.cuda_graph is True:
        return cuda_graph_refusal(cfg)
    return None


def _pieces_refusal(cfg: RunConfig) -> str | None:
    """The first rule a ``train.recompute_pieces > 1`` config breaks (one line), or None: the
    halves in token pieces must compute what the whole halves compute (k3train/model/recompute.py,
    ``_ffn_in_pieces``, ``_mixer_in_pieces``)."""
    t, moe, n = cfg.train, cfg.moe, cfg.train.recompute_pieces
    has_moe = cfg.model.dense_layers < cfg.model.num_layers
    if not t.offload_activations:
        return (f"train.recompute_pieces={n} cuts the layer halves that train.offload_activations=true "
                f"makes regions of their own; set train.offload_activations=true or recompute_pieces=1")
    if has_moe and moe.balancing == "aux_loss":
        return (f"train.recompute_pieces={n} with moe.balancing=aux_loss: the balance loss is a "
                f"statistic of the whole window, not of a piece; use quantile, aux_free or none, "
                f"or recompute_pieces=1")
    if has_moe and moe.capacity_factor is not None:
        return (f"train.recompute_pieces={n} with moe.capacity_factor={moe.capacity_factor}: the static "
                f"dispatcher's capacity (and so what it drops) depends on the tokens per call; unset "
                f"moe.capacity_factor or use recompute_pieces=1")
    if has_moe and cfg.parallel.ep > 1:
        return (f"train.recompute_pieces={n} with parallel.ep={cfg.parallel.ep}: not yet run with "
                f"expert parallelism's all-to-alls per piece; use parallel.ep=1 or recompute_pieces=1")
    local = t.seq_len // cfg.parallel.cp
    if local < n:
        return (f"train.recompute_pieces={n} is more than the {local} tokens per window this rank "
                f"holds (train.seq_len / parallel.cp); use at most {local}")
    return None
