"""Which layouts of a model fit a GPU's memory, and how fast each would run (predicted):
``k3train model-info --fit GIB`` (docs/memory.md#which-layouts-fit-a-gpu-model-info---fit).

For each world size and task (pretraining at 4096 tokens, SFT at 32768), every layout
(tp, pp, vpp, ep, dp, cp, micro-batch) is planned once (``memory_plan.plan_memory``, CUDA
kernels at bf16), and every weight/state choice (param_dtype, state_dtype, ZeRO-1) and recompute
mode is read off that plan. A layout fits when its heaviest rank's planned total is at most
``fit_gib x (1 - margin)``; of its fitting choices it keeps the fastest recompute mode, then
fp32 moments before bf16, then the least memory.

Speed is PREDICTED, never measured here: each chunk's forward and backward cost its training
FLOPs (``predict.layer_flops``, split over tp and cp) at the K3 slice's measured forward+backward
rate on one H200 (``SLICE_RATE``), the recomputed forward added to the backward, and the
pipeline schedule is replayed by ``pipeline.timing_model.predict_step`` with the p2p messages
the engine sends. Two figures: ``mfu_hidden`` with every collective hidden behind compute, and
``mfu_exposed`` with the expert all-to-alls and the tensor-parallel all-reduces added to the
chunks' times (``_comm_per_layer``). Not counted in either: the DP gradient reduction and ZeRO-1
gathers (overlapped, once per update), the optimizer step, the CP exchanges, load imbalance.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3train.config import RunConfig
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.config.schema import RECOMPUTE_MODES
from k3train.errors import UsageError
from k3train.model.flops import DATASHEET_BF16_PEAK, flops_breakdown
from k3train.profiling.memory_plan import GiB, StateLayout, plan_memory
from k3train.profiling.predict import layer_flops, layout_messages
from pipeline.layout import split_layers
from pipeline.schedule import check_microbatches
from pipeline.timing_model import LinkCost, OpCosts, predict_step

# The K3 slice's forward+backward rate on one H200, bf16, 1 x 4096 tokens per microbatch:
# 58.5% of the 738 TFLOP/s matmul rate measured in that run (43.6% of the datasheet peak),
# benchmarks/2026-12-02_all_figures-page.md#k3-slice-one-h200. The slice has K3's widths and one
# EP=28 rank's experts at top-16, so its per-token GEMM shapes are a K3 rank's.
SLICE_RATE = 0.585 * 738e12
PEAK = dict(DATASHEET_BF16_PEAK)["H200"]          # MFU's denominator, as the field counts it
NEMO_K3_PRETRAIN_MFU = 0.137                      # NeMo Automodel, K3 pretraining, 64 nodes (issue 42)
NVLINK = LinkCost(latency_s=32e-6, bandwidth_Bps=315e9)   # 2x H200 p2p (k3train.profiling.predict)
INTER_NODE = LinkCost(latency_s=32e-6, bandwidth_Bps=50e9)  # 400 Gb/s per GPU between nodes
TASKS = {"pretrain": 4096, "sft": 32768}
TP_SIZES, PP_SIZES, VPP_SIZES, CP_SIZES, MICRO_BATCHES = (1, 2, 4, 8), (1, 2, 4, 8, 12, 16, 24, 32), (1, 2), \
    (1, 2, 4, 8), (1, 2)
# The weight/state choices tried, the exact-update ones first (fp32 moments).
STATES = tuple(StateLayout(p, s, z) for s in ("fp32", "bf16") for p in ("fp32", "bf16") for z in (False, True))


@dataclass(frozen=True)
class Layout:
    """One parallel layout on ``tp * pp * cp * dp`` GPUs, ``ep`` dividing ``dp``."""

    tp: int
    pp: int
    vpp: int
    ep: int
    dp: int
    cp: int
    micro_batch: int
    microbatches: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

@dataclass
class Fit:
    """A layout that fits, with the choices it fits with and its predicted speed."""

    task: str
    seq_len: int
    layout: Layout
    state: StateLayout
    recompute: str
    heaviest_bytes: float
    mfu_hidden: float
    mfu_exposed: float
    bubble: float


def _layout_cfg(cfg: RunConfig, lay: Layout, seq_len: int) -> RunConfig:
    """``cfg`` with the layout's parallel and train fields (unvalidated: the search plans CP
    layouts the schema refuses today, and says so)."""
    par = cfg.parallel.model_copy(update={"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "cp": lay.cp})
    train = cfg.train.model_copy(update={"seq_len": seq_len, "micro_batch_size": lay.micro_batch,
                                         "microbatches": lay.microbatches})
    return cfg.model_copy(update={"parallel": par, "train": train})


def _microbatches(batch_tokens: int, dp: int, mb: int, seq_len: int, pp: int, vpp: int) -> int | None:
    """Microbatches per update for ``batch_tokens`` over ``dp`` replicas, at least one, rounded
    up to a multiple of pp under interleaving (Megatron's rule; the update grows then); None
    when none is valid. Fewer than pp keep fewer microbatches in flight (less memory) and leave
    the pipeline idle longer (the bubble column)."""
    m = max(1, batch_tokens // (dp * mb * seq_len))
    if vpp > 1:
        m = -(-max(m, pp) // pp) * pp
    try:
        check_microbatches(pp, vpp, m)
    except ValueError:
        return None
    return m


def candidate_layouts(cfg: RunConfig, world: int, seq_len: int, batch_tokens: int, task: str) -> list[Layout]:
    """Every layout of ``world`` GPUs the search tries: tp within a node (8 GPUs) dividing the
    attention heads, pp x vpp at most the layers, ep dividing both the experts and dp, cp
    (SFT only) dividing the sequence, micro-batch 1 or 2 (pretraining) or 1 (SFT)."""
    m = cfg.model
    heads = (m.kda.num_heads, m.mla.num_heads)
    out = []
    for tp in TP_SIZES:
        if any(h % tp for h in heads):
            continue
        for cp in (CP_SIZES if task == "sft" else (1,)):
            if seq_len % cp or tp * cp > 8:
                continue
            for pp in PP_SIZES:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                for vpp in VPP_SIZES:
                    if pp * vpp > m.num_layers or (vpp > 1 and pp == 1):
                        continue
                    for mb in (MICRO_BATCHES if task == "pretrain" else (1,)):
                        n = _microbatches(batch_tokens, dp, mb, seq_len, pp, vpp)
                        if n is None:
                            continue
                        for ep in range(1, dp + 1):
                            if dp % ep == 0 and cfg.moe.num_experts % ep == 0:
                                out.append(Layout(tp, pp, vpp, ep, dp, cp, mb, n))
    return out


def _comm_per_layer(cfg: RunConfig, lay: Layout, seq_len: int, recompute: str) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each layer's exposed collectives for one microbatch:
    the expert all-to-alls (dispatch and combine of k latent rows per token, bf16; again in the
    recomputed forward unless ``none``) and the tensor-parallel all-reduces of the hidden state
    (two per sublayer pair each way, ring over NVLink). EP peers in the node go over NVLink, the
    rest over the 50 GB/s inter-node link, in parallel (the slower one counts)."""
    m, moe = cfg.model, cfg.moe
    tokens = lay.micro_batch * seq_len // lay.cp
    a2a = tokens * moe.topk * moe.latent_size * 2
    g = max(1, min(lay.ep, 8 // (lay.tp * lay.cp)))          # EP peers in one node (tp, cp innermost)
    t_a2a = 0.0 if lay.ep == 1 else max(NVLINK.time(a2a * (g - 1) / lay.ep) if g > 1 else 0.0,
                                        INTER_NODE.time(a2a * (lay.ep - g) / lay.ep) if lay.ep > g else 0.0)
    hidden = tokens * m.hidden_size * 2
    t_tp = 0.0 if lay.tp == 1 else 2 * NVLINK.time(2 * (lay.tp - 1) / lay.tp * hidden)
    again = recompute != "none"
    out = []
    for i in range(m.num_layers):
        ep = 2 * t_a2a if i >= m.dense_layers else 0.0
        out.append((ep + t_tp, ep * (2 if again else 1) + t_tp * (2 if again else 1)))
    return out


def predict_mfu(cfg: RunConfig, lay: Layout, seq_len: int, recompute: str) -> tuple[float, float, float]:
    """(mfu_hidden, mfu_exposed, bubble) of ``lay`` under ``recompute`` (module docstring),
    against the H200's datasheet bf16 peak. PREDICTED."""
    lcfg = _layout_cfg(cfg, lay, seq_len)
    per_layer, head = layer_flops(lcfg)
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    br = flops_breakdown(lcfg)
    core = {"K": br["kda_recurrence"] / max(1, kinds.count("K")), "M": br["mla_attention"] / max(1, kinds.count("M"))}
    scale = lay.micro_batch * seq_len / (lay.tp * lay.cp) / SLICE_RATE     # seconds per (FLOP per token)
    comm = _comm_per_layer(cfg, lay, seq_len, recompute)
    C = lay.pp * lay.vpp
    counts = split_layers(cfg.model.num_layers, C)
    results = []
    for exposed in (False, True):
        fwd, bwd, start = [], [], 0
        for c, n in enumerate(counts):
            f = b = 0.0
            for i in range(start, start + n):
                again = {"none": 0.0, "full": per_layer[i] / 3,
                         "selective": (per_layer[i] - core[kinds[i]]) / 3}[recompute]
                f += per_layer[i] / 3 * scale + (comm[i][0] if exposed else 0.0)
                b += (2 * per_layer[i] / 3 + again) * scale + (comm[i][1] if exposed else 0.0)
            if c == C - 1:
                f, b = f + head / 3 * scale, b + 2 * head / 3 * scale
            fwd.append(f)
            bwd.append(b)
            start += n
        link = INTER_NODE if lay.tp * lay.cp * lay.dp >= 8 else NVLINK   # a stage spans whole nodes
        msgs = layout_messages(lcfg, lay.pp, lay.vpp, wire_bytes=2) if C > 1 else []
        pred = predict_step(lay.pp, lay.vpp, lay.microbatches, OpCosts(tuple(fwd), tuple(bwd)), msgs, link)
        flops = (sum(per_layer) + head) * lay.microbatches * lay.micro_batch * seq_len
        results.append((flops / (lay.tp * lay.pp * lay.cp * pred.step_s * PEAK), pred.bubble))
    return results[0][0], results[1][0], results[1][1]


def memory_microbatches(pp: int, vpp: int, m: int) -> int:
    """Microbatches to replay for the memory peak: the schedule's peak comes in its warm-up and
    first steady groups, so beyond ``2 P (V + 1)`` (a multiple of P) more microbatches only
    repeat it (``tests/profiling/test_layout_fit.py`` checks the peaks equal)."""
    cap = 2 * pp * (vpp + 1)
    return m if m <= cap else cap


def _plans(cfg: RunConfig, lay: Layout, seq_len: int):
    """The layout's per-rank plans (CUDA kernels, bf16 activations), or None where the pipeline
    cannot split the model so (``plan_memory``'s ValueError)."""
    short = Layout(**{**lay.__dict__, "microbatches": memory_microbatches(lay.pp, lay.vpp, lay.microbatches)})
    try:
        return plan_memory(_layout_cfg(cfg, short, seq_len), ops="fused", act_bytes=2, dp=lay.dp, cp=lay.cp,
                           step_microbatches=lay.microbatches)
    except ValueError:
        return None


def fit_layouts(cfg: RunConfig, *, worlds: list[int], fit_gib: float, margin: float = 0.1,
                tasks: tuple[str, ...] = tuple(TASKS), batch_tokens: int = 1 << 24) -> dict[tuple[str, int], list[Fit]]:
    """{(task, world): fitting layouts, best first}: the highest ``mfu_exposed``, then the least
    memory (context parallelism composes with every layout searched here). The budget is
    ``fit_gib x (1 - margin)`` GiB for the heaviest rank's planned total."""
    if fit_gib <= 0 or not 0 <= margin < 1:
        raise UsageError(f"--fit needs a positive GiB budget and --margin a fraction in [0, 1); "
                         f"got {fit_gib} and {margin}")
    budget = fit_gib * (1 - margin) * GiB
    out: dict[tuple[str, int], list[Fit]] = {}
    for task in tasks:
        seq = TASKS[task]
        for world in worlds:
            fits = []
            for lay in candidate_layouts(cfg, world, seq, batch_tokens, task):
                plans = _plans(cfg, lay, seq)
                if plans is None:
                    continue
                best = None
                for mode in RECOMPUTE_MODES:          # none, selective, full: fastest first
                    for state in STATES:
                        heaviest = max(q.total(mode, state.zero1, state) for q in plans)
                        if heaviest <= budget:
                            key = (state.state_dtype == "bf16", heaviest)
                            if best is None or key < best[0]:
                                best = (key, state, heaviest)
                    if best is not None:
                        hidden, exposed, bubble = predict_mfu(cfg, lay, seq, mode)
                        fits.append(Fit(task, seq, lay, best[1], mode, best[2], hidden, exposed, bubble))
                        break
            fits.sort(key=lambda f: (-f.mfu_exposed, f.heaviest_bytes))
            out[(task, world)] = fits
    return out


def smallest_heaviest(cfg: RunConfig, world: int, task: str, batch_tokens: int = 1 << 24) -> tuple[float, Layout]:
    """(GiB, layout) of the lightest heaviest rank over every layout and choice: what blocks a
    fit when none fits."""
    seq = TASKS[task]
    best = (float("inf"), None)
    lightest = StateLayout("bf16", "bf16", True)
    for lay in candidate_layouts(cfg, world, seq, batch_tokens, task):
        plans = _plans(cfg, lay, seq)
        if plans is None:
            continue
        gib = max(q.total("full", True, lightest) for q in plans) / GiB
        best = min(best, (gib, lay), key=lambda x: x[0])
    return best


def format_fits(cfg: RunConfig, fits: dict[tuple[str, int], list[Fit]], *, fit_gib: float, margin: float,
                top: int, gpus_per_node: int, batch_tokens: int) -> str:
    lines = [f"layouts whose heaviest rank fits {fit_gib:g} GiB less a {margin:.0%} margin "
             f"({fit_gib * (1 - margin):.1f} GiB planned), best first by predicted MFU with the collectives "
             f"exposed; {batch_tokens:,} tokens per update; CUDA kernels at bf16",
             f"MFU is PREDICTED: training FLOPs at the K3 slice's measured forward+backward rate on one H200 "
             f"({SLICE_RATE / 1e12:.0f} TFLOP/s), the pipeline replayed by the timing model, over the "
             f"{PEAK / 1e12:.0f} TFLOP/s datasheet peak (NeMo Automodel measured {NEMO_K3_PRETRAIN_MFU:.1%} "
             f"for K3 pretraining on 64 nodes); see docs/memory.md"]
    head = (f"{'nodes':>6}{'tp':>4}{'pp':>4}{'vpp':>4}{'ep':>5}{'edp':>5}{'dp':>5}{'cp':>4}{'mb':>4}{'m':>5}"
            f"{'tok/upd':>8}{'zero1':>7}{'weights':>9}{'moments':>9}{'recompute':>11}{'GiB':>8}{'bubble':>8}"
            f"{'MFU hidden':>12}{'MFU exposed':>13}")
    for (task, world), rows in fits.items():
        lines.append(f"\n{task} (seq_len {TASKS[task]}), {world // gpus_per_node} nodes x {gpus_per_node} GPUs: "
                     f"{len(rows)} layouts fit" + ("" if rows else " (none)"))
        if not rows:
            gib, lay = smallest_heaviest(cfg, world, task, batch_tokens)
            if lay is not None:
                lines.append(f"  blocked: the lightest layout (tp={lay.tp} pp={lay.pp} vpp={lay.vpp} ep={lay.ep} "
                             f"dp={lay.dp} cp={lay.cp}, full recompute, bf16 weights and moments, ZeRO-1) "
                             f"needs {gib:.1f} GiB")
            continue
        lines.append(head)
        for f in rows[:top]:
            L = f.layout
            lines.append(f"{L.world // gpus_per_node:>6}{L.tp:>4}{L.pp:>4}{L.vpp:>4}{L.ep:>5}{L.dp // L.ep:>5}{L.dp:>5}"
                         f"{L.cp:>4}{L.micro_batch:>4}{L.microbatches:>5}"
                         f"{L.dp * L.microbatches * L.micro_batch * f.seq_len / 2**20:>7.0f}M{str(f.state.zero1).lower():>7}"
                         f"{f.state.param_dtype:>9}{f.state.state_dtype:>9}{f.recompute:>11}"
                         f"{f.heaviest_bytes / GiB:>8.1f}{f.bubble:>8.3f}{f.mfu_hidden:>11.1%}*{f.mfu_exposed:>12.1%}*")
    lines.append("\n* predicted, not measured")
    return "\n".join(lines)
