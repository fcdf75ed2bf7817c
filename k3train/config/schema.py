"""Typed, validated run configuration: the run-level sections (train, optim, parallel,
pipeline, precision, checkpoint, logging, kernels) and ``RunConfig``, which holds them with the
model's (``model_schema``) and the data's (``data_schema``) and checks rules across sections.

Every field has a default that suits the CPU quickstart; YAML files in ``configs/`` override
them and ``key.sub=value`` arguments override the YAML. Unknown keys are rejected (a typo must
never silently fall back to a default).
"""
from __future__ import annotations

import re
from typing import Literal, Union, get_args

from pydantic import Field, model_validator

from k3train.config import layout_rules
# The model's and the data's sections live beside this module; importable from here as before.
from k3train.config.data_schema import DataConfig, DataSourceConfig, MQARConfig  # noqa: F401
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.config.model_schema import (AttnResConfig, FFNConfig, KDAConfig, MLAConfig,  # noqa: F401
                                         ModelConfig, MoEConfig)
from k3train.config.strict import StrictModel

RecomputeMode = Literal["none", "selective", "full"]
# The one list of activation-recompute modes (train.recompute, k3train/model/recompute.py, the
# memory plan).
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)


class TrainConfig(StrictModel):
    steps: int = Field(200, ge=1)
    """Optimizer steps of the run."""
    seed: int = 1234
    """Seed of initialisation, data order and sampling."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per microbatch (per data-parallel rank)."""
    microbatches: int = Field(1, ge=1)
    """Microbatches per step (gradient accumulation; pipeline microbatches when pp > 1)."""
    seq_len: int = Field(128, ge=2)
    """Tokens per training sequence."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables it."""
    log_interval: int = Field(10, ge=1)
    """Log metrics every N steps."""
    eval_interval: int = Field(50, ge=1)
    """Evaluate the validation loss every N steps."""
    eval_batches: int = Field(4, ge=1)
    """Validation batches per evaluation (k3train eval uses the whole split by default)."""
    plots: bool = True
    """At the end of a run that trained: write loss.png, expert_load.png and attnres_depth.png
    in the run directory and log them as images (docs/run_directory.md). false skips them and
    the forward over a validation batch the depth heatmap needs (most of a second of a tiny CPU run)."""
    max_consecutive_skips: int = Field(5, ge=1)
    """Steps with a non-finite loss or gradient are skipped; this many in a row stop the run."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available, else CPU."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch in every command (train, eval, generate). 0: the cores available
    divided by the processes torchrun starts on this host, or OMP_NUM_THREADS where set."""
    compile_ahead: bool = True
    """On CUDA with fla's kernels: compile every Triton kernel of the step in parallel before
    step 1 (a throwaway forward/backward; weights untouched). No effect on CPU."""
    cuda_graph: Union[bool, Literal["auto"]] = "auto"
    """Capture the step's forward and backward in CUDA graphs after two eager steps and replay
    them (k3train/trainer/cuda_graph.py): the host no longer launches every kernel. One graph
    of the whole step without pipeline parallelism; one per chunk per in-flight microbatch under
    it (pipeline/chunk_graphs.py); gradients are reduced over data parallelism after the replay.
    Needs a CUDA device, parallel.tp = 1, and under parallel.ep > 1 the static dispatcher
    (moe.capacity_factor set: its all-to-all has fixed splits and is recorded in the graph;
    the dynamic one reads split sizes on the host). true: required (an error otherwise);
    "auto" (default): on exactly where supported, and the banner says what it resolved to;
    false: off."""
    recompute: RecomputeMode = "none"
    """Activation checkpointing of every layer (k3train/model/recompute.py). none: autograd keeps
    every activation (fastest, most memory). full: a layer keeps only its inputs (hidden state
    and the AttnRes blocks it reads, stored once) and recomputes its whole forward in backward
    (least memory, about one extra forward). selective: keeps the KDA and attention core outputs
    (costly to recompute) and recomputes norms, projections, convs, gates, depth mixes and the
    FFN. Default none: recompute trades tokens/s for memory (benchmarks/README.md, "Activation
    recompute on k3_mini"); turn it on when activations do not fit, not by default."""
    offload_activations: bool = False
    """Keep what recompute keeps (each layer's checkpointed inputs, the AttnRes blocks; under
    selective also the kept core outputs) in pinned host memory instead of on the GPU, copied
    out beside the forward and back at each recompute (k3train/model/offload.py); each layer is
    then checkpointed as two regions (mixer half, FFN half), so the backward recomputes half a
    layer at a time. For sequences whose activations do not fit otherwise (docs/long_context.md:
    1M tokens on one GPU). Needs train.recompute full or selective; rules out train.cuda_graph.
    Bitwise the same losses and gradients."""

    recompute_pieces: int = Field(1, ge=1)
    """Under train.offload_activations: each layer's FFN half (norm, depth mix, dense FFN or
    MoE, all per token) and its mixer half (KDA: the conv's halo of tokens and the recurrent
    state handed from piece to piece; MLA: the whole window's latent, then each piece's queries
    against its prefix; not under parallel.cp, whose exchanges own the sequence) run as this
    many regions over consecutive token pieces of the window, so the backward recomputes one
    piece's activations at a time instead of the whole window's. Losses and gradients are those
    of 1 up to the order of the weight gradients' sums. On one H200 8 FFN pieces moved k3_mini's
    256K peak by 1%; the mixer pieces are measured on CPU only (docs/long_context.md); 1: off.
    Refused with what is not per token: moe.balancing=aux_loss, moe.capacity_factor,
    parallel.ep > 1."""

    @model_validator(mode="after")
    def _offload_needs_recompute(self) -> "TrainConfig":
        if self.offload_activations and self.recompute == "none":
            raise ValueError("train.offload_activations=true offloads what recompute keeps; it needs "
                             "train.recompute=full or selective (got none)")
        return self
    init_from: Union[str, None] = None
    """Fine-tuning: a checkpoint (a step directory, or a checkpoints/ or run directory) whose
    weights start this run, whatever parallel layout wrote it. Weights only: the optimizer,
    the lr schedule and the data position start fresh (docs/checkpoints.md). Ignored when
    --resume finds a checkpoint of this run (that one already holds the fine-tuned weights)."""
    allow_model_change: bool = False
    """--resume onto a checkpoint whose tensors differ from this config's model (a tensor on one
    side only, e.g. model.attnres.enabled changed): false refuses the resume naming the
    difference; true drops the checkpoint's extra tensors, starts the model's new ones from
    their initialisation, prints both lists and resumes."""
    allow_optimizer_change: bool = False
    """--resume onto a checkpoint trained with another optimizer (optim.name, or a parameter
    the table now gives to the other optimizer): false refuses naming the difference; true
    starts the changed parameters' optimizer state fresh, prints them and resumes."""
    allow_data_change: bool = False
    """--resume onto other training data than the checkpoint's (another data.source, or a
    dataset re-prepared at the same prefix: its content_sha256 differs from the one the
    checkpoint's manifest records): false refuses naming both; true prints a warning and
    continues the optimizer, schedule and data position on the new data."""
    async_save: bool = False
    """Checkpoints written by a background thread from a host-memory snapshot while the next
    steps train (k3train/trainer/async_save.py); at most one save in flight, committed (manifest,
    latest) only when every rank's file is complete. The snapshot's host buffers (pinned on
    CUDA) are kept for the run: one checkpoint's worth of host memory per rank, allocated at the
    first save (docs/checkpoints.md). false: training waits for each save."""


class OptimConfig(StrictModel):
    name: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon (Muon for matrices, AdamW for the rest)."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of lr (cosine and wsd)."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW's first-moment decay (Muon's momentum)."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW's second-moment decay."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warm-up."""
    zero1: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1): each rank owns whole Muon
    matrices and a slice of the AdamW parameters; see docs/optim_sharding.md."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype of AdamW's moments and Muon's momentum (docs/memory.md#layouts): bf16 halves
    them (4 bytes per parameter instead of 8 for AdamW); they are stepped in fp32 and rounded
    on the store. Checkpoints hold them as fp32 either way."""
    muon_per_head: bool = True
    """Orthogonalise q/k/v projection updates head by head (K3) rather than whole."""
    muon_distributed: bool = True
    """Run Muon's Newton-Schulz once per matrix block per group of ranks holding copies of it
    (dense weights: data parallel; routed experts: expert data parallel), on an owner balanced
    by FLOPs, and all-gather the updates; false: every rank orthogonalises every matrix it holds
    (the replicated step, kept for comparison). Same update and checkpoint either way. Under
    zero1 each matrix already has one owner, so this field changes nothing there
    (docs/optim_sharding.md#muon-once-per-matrix)."""
    muon_ns: Literal["standard", "gram", "auto"] = "standard"
    """Muon's Newton-Schulz form: standard (five quintic steps on each block), gram (the same
    polynomial map iterated on the small Gram matrix X X^T, restarted once; fewer FLOPs on blocks
    far from square), or auto (gram where it needs at most half the FLOPs: aspect >= 11.5, e.g.
    the per-head q/k/v blocks). standard stays the default: bf16 parity with it is not shown
    (docs/optim_sharding.md#gram-newton-schulz)."""


class ParallelConfig(StrictModel):
    tp: int = Field(1, ge=1)
    """Tensor-parallel ranks (megatron-core linears)."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel ranks."""
    vpp: int = Field(1, ge=1)
    """Virtual pipeline stages (model chunks) per pipeline rank."""
    ep: int = Field(1, ge=1)
    """Expert-parallel ranks (inside data parallel)."""
    cp: int = Field(1, ge=1)
    """Context-parallel ranks: each sequence split into cp contiguous chunks of seq_len/cp tokens,
    one per rank (docs/long_context.md). KDA folds its state over the ranks, the short convs take
    a halo from the previous rank, MLA all-gathers its compact latent; weight gradients are
    reduced over DP x CP. World = tp * pp * cp * dp. Composes with DP, PP (any vpp), EP (the
    expert group may span CP x DP), TP, ZeRO-1, Muon and every balancer; refused for now with
    and CUDA graphs. Document masking crosses ranks (a document that spans ranks passes state)."""
    cp_partition: Literal["contiguous", "head_tail"] = "contiguous"
    """How parallel.cp cuts each sequence: contiguous (rank r holds tokens [r T, (r+1) T), T =
    seq_len/cp) or head_tail (2*cp pieces, rank r holds pieces r and 2*cp-1-r: every rank scores
    the same number of causal attention pairs; the last contiguous rank does (2cp-1)/cp x the
    mean). Every layer runs on the same pieces; head_tail doubles the KDA fold's bytes (two [E, M]
    per rank and layer) and needs seq_len divisible by 2*cp. A checkpoint does not depend on it: a
    run may resume under the other partition (docs/long_context.md#the-partition)."""


class PipelineConfig(StrictModel):
    attnres_transport: Literal["cached", "naive"] = "cached"
    """How AttnRes blocks cross pipeline stages: cached (each block sent once) or naive (all blocks every hop)."""
    p2p_backend: Literal["auto", "gloo"] = "auto"
    """auto: pipeline messages go over the run's backend (NCCL on GPUs). gloo: over gloo, through
    host memory, on GPUs too; slower (two copies per message), a fallback where NCCL p2p hangs."""


class PrecisionConfig(StrictModel):
    """Low-precision recipe and the modules it applies to (docs/quantization.md)."""

    recipe: Literal["bf16", "fp32", "fp8", "mxfp8", "mxfp4_qat"] = "bf16"
    """bf16: bf16 autocast on CUDA, fp32 on CPU. fp32: no autocast on any device (GPU reference
    runs: parallel GPU runs then agree with one GPU to fp32 rounding, not bf16's). mxfp4_qat:
    MXFP4 (E2M1) weights + MXFP8 (E4M3) activations, fake-quantised with straight-through
    gradients (K3). mxfp8: E4M3 weights and activations, same mechanism. fp8: torchao float8
    training on CUDA (compute capability >= 8.9), the routed experts through an FP8 grouped GEMM
    under ``fp8_experts``."""
    scope: list[str] | None = None
    """Regexes searched (``re.search``) in module names with global layer indices, e.g.
    ``layers.3.ffn.experts``. A matched container quantises every quantisable module inside it
    (grouped experts, nn.Linear, tensor-parallel linears; never the router). None: the recipe's
    default, routed experts (``\\.ffn\\.experts$``) for mxfp4_qat/mxfp8; for fp8 the latent
    projections, shared experts and attention projections, and the routed experts under
    ``fp8_experts`` (docs/k3_slice.md#what-fp8-covers). Other names: ``\\.ffn\\.shared$`` shared experts,
    ``\\.ffn\\.(down|up)$`` latent projections, ``\\.ffn\\.(gate|up|down)_proj$`` dense FFN,
    ``\\.mixer\\.`` attention projections. A pattern that selects nothing is an error."""
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype the model's weights are kept in (docs/memory.md#layouts). fp32: the optimizer
    steps the weights themselves. bf16: 2-byte weights; gradients accumulate in an fp32
    ``main_grad`` per weight, the optimizer steps fp32 main parameters (sharded with
    ``optim.zero1``) and rounds them into the weights; checkpoints store the fp32 main values
    under the weights' names, so either setting resumes the other. Not with CUDA graphs."""
    fp8_experts: bool = False
    """fp8 only, with the default scope: the routed experts' three grouped GEMMs in float8 too
    (E4M3, rowwise power-of-two scales: torchao's grouped GEMM on CUDA, its exact emulation
    elsewhere; docs/quantization.md#fp8-routed-experts). Off by default until the CUDA path has
    been checked on an H200 against its emulation (``scripts/gpu_check_fp8_experts.py``)."""
    fp8_backend: Literal["torchao", "te"] = "torchao"
    """Who runs recipe fp8's GEMMs: ``torchao`` (its float8 training matmul; the ``gpu`` extra) or
    ``te`` (Transformer Engine linears in the scope under TE's autocast; the ``te`` extra,
    docs/quantization.md#transformer-engine). Checkpoints are the same tensors either way."""
    fp8_recipe: Literal["current", "delayed", "blockwise"] = "current"
    """Scaling for recipe fp8: ``current``, dynamic tensorwise scaling (torchao's tensorwise,
    TE's Float8CurrentScaling); ``delayed``, TE's DelayedScaling (scales from an amax history);
    ``blockwise``, TE's Float8BlockScaling (1x128 activation, 128x128 weight blocks; Hopper, CUDA
    >= 12.9). delayed and blockwise need ``fp8_backend: te``."""

    @model_validator(mode="after")
    def _scope_compiles(self) -> "PrecisionConfig":
        if self.recipe == "fp32" and self.param_dtype != "fp32":
            # recipe fp32 is the reference run (fp32 math everywhere); bf16 weights would make
            # every matmul a bf16 one without autocast's fp32 reductions.
            raise ValueError(f"precision.param_dtype={self.param_dtype} with precision.recipe=fp32: the fp32 "
                             f"reference recipe needs fp32 weights; use param_dtype=fp32 or another recipe")
        for pattern in self.scope or []:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"precision.scope pattern {pattern!r} is not a valid regex ({exc})") from None
        if self.fp8_backend == "torchao" and self.fp8_recipe != "current":
            raise ValueError(f"precision.fp8_recipe={self.fp8_recipe} needs precision.fp8_backend=te "
                             f"(torchao runs current scaling only; allowed with torchao: current)")
        return self


class CheckpointConfig(StrictModel):
    interval: int = Field(0, ge=0)
    """Save every N steps (0: only at the end of the run)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are pruned."""


class WandbConfig(StrictModel):
    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline (default, no network), online, or disabled."""
    project: str = "k3train"
    """wandb project."""
    group: str | None = None
    """wandb group (a sweep sets its name)."""
    name: str | None = None
    """wandb run name."""


class LoggingConfig(StrictModel):
    wandb: WandbConfig = WandbConfig()
    progress_bar: bool = True
    """Show a progress bar with the loss."""
    tensorboard: bool = False
    """Also write every metrics.jsonl record's scalars as TensorBoard event files in
    ``RUN_DIR/tensorboard/`` (``tensorboard --logdir RUN_DIR``); needs the ``tensorboard``
    extra (``pip install 'k3train[tensorboard]'``)."""


class KernelsConfig(StrictModel):
    """Which implementation each op family runs (``k3train/ops/kernels.py`` resolves these once per
    run and writes the resolved choices to ``RUN_DIR/kernels.json``). Off CUDA every family runs
    its pure-torch form; the choices below apply to CUDA tensors."""

    backend: Literal["auto", "torch"] = "auto"
    """auto: each family's ``auto`` picks its fastest installed kernel on CUDA. torch: every
    family runs its pure-torch form on every device (comparing backends, debugging, or a GPU
    where Triton compilation is too slow to wait for). ``K3TRAIN_KERNELS`` overrides it."""
    kda: Literal["auto", "fla", "torch"] = "auto"
    """The chunked KDA recurrence: fla's ``chunk_kda`` (the ``gpu`` extra) or the torch form."""
    attnres: Literal["auto", "fla", "torch"] = "auto"
    """The AttnRes depth mix: fla's ``fused_attnres`` or the torch form."""
    short_conv: Literal["auto", "k3train", "fla", "torch"] = "auto"
    """The KDA short convolution + SiLU: ours (Triton, ``ops/short_conv_triton.py``), fla's
    ``causal_conv1d``, or torch's ``conv1d``. auto: ours."""
    router_topk: Literal["auto", "k3train", "torch"] = "auto"
    """The router's and Quantile Balancing's row top-k: ours (Triton) or ``torch.topk``."""
    moe_permute: Literal["auto", "k3train", "torch"] = "auto"
    """MoE dispatch and combine row passes (``moe/permute_fused.py``): ours (one Triton pass
    each way) or the torch gathers."""
    muon_momentum: Literal["auto", "k3train", "torch"] = "auto"
    """Muon's momentum + Nesterov pass: ours (one Triton pass) or two torch passes."""
    ns_gemm: Literal["auto", "k3train", "torch"] = "auto"
    """Muon's Newton-Schulz ``beta C + alpha A B``: ours (reads C in its epilogue) or
    ``torch.baddbmm``."""
    compile: bool | Literal["auto"] = "auto"
    """``torch.compile`` of the small fused pieces on CUDA (RMSNorm x gate, SiTU-GLU, the MoE
    combine, fp8's scaling and casts around each float8 GEMM): true, false, or auto: on (under
    pipeline parallelism too: train.compile_ahead compiles them on every rank before step 1, so
    no rank stalls inside it while its peers wait). ``K3TRAIN_COMPILE=0|1`` overrides it."""
    autotune: Literal["full", "fixed"] = "full"
    """full: Triton's autotuners time every candidate (speed runs). fixed: one candidate per
    autotuned kernel, the one with the smallest tiles (correctness runs that should not wait for
    tuning; never for speed figures). ``K3TRAIN_AUTOTUNE`` overrides it."""
    autotune_picks: str = "auto"
    """Under ``full``: where recorded autotune choices come from, so that a fresh machine compiles
    and runs only the chosen candidate of each kernel (``k3train/ops/autotune_picks.py``).
    auto: the project's file for this GPU model, ``k3train/ops/autotune_data/<gpu>.json``, where
    one ships; none: tune every kernel; or the path of a picks file (every full-autotune run
    writes its own, ``RUN_DIR/autotune_picks.json``). A launch the file does not cover is tuned."""
    autotune_bench_ms: float = Field(default=25.0, ge=0.0)
    """Under ``full``: how long each candidate is timed, in ms (its warm-up is a fifth of that),
    where Triton's default is 100 ms after a 25 ms warm-up. Step 1 of a fresh run tunes about
    25 kernels of 6-36 candidates each, and at the default that alone took 1-3 s per kernel;
    25 ms still times a kernel of up to 1 ms at least 25 times and keeps the median. 0: Triton's
    own window. A kernel that brings its own benchmark function keeps it."""


class RunConfig(StrictModel):
    """The whole run: one YAML file maps onto this object."""

    model: ModelConfig = ModelConfig()
    moe: MoEConfig = MoEConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    kernels: KernelsConfig = KernelsConfig()

    def cuda_graph_blockers(self, *, device: str | None = None, auto: bool = False) -> dict[str, str]:
        """What rules out ``train.cuda_graph`` (``layout_rules.cuda_graph_blockers``)."""
        return layout_rules.cuda_graph_blockers(self, device=device, auto=auto)

    def cuda_graph_refusal(self, *, device: str | None = None) -> str | None:
        """Why ``train.cuda_graph: true`` cannot run, or None (``layout_rules.cuda_graph_refusal``)."""
        return layout_rules.cuda_graph_refusal(self, device=device)

    @model_validator(mode="after")
    def _cross_field_checks(self) -> "RunConfig":
        m = self.model
        expand_layer_pattern(m.layer_pattern, m.num_layers)  # raises with a precise message
        if m.dense_layers > m.num_layers:
            raise ValueError(f"model.dense_layers ({m.dense_layers}) exceeds model.num_layers ({m.num_layers})")
        refusal = layout_rules.layout_refusal(self)
        if refusal is not None:
            raise ValueError(refusal)
        pr = self.precision
        if (pr.recipe == "fp8" and pr.fp8_backend == "te" and pr.fp8_recipe == "delayed"
                and self.train.recompute != "none"):
            # A recomputed forward would update DelayedScaling's amax history a second time.
            raise ValueError(f"precision.fp8_recipe=delayed (Transformer Engine) does not run with "
                             f"train.recompute={self.train.recompute}; use fp8_recipe current or "
                             f"blockwise, or train.recompute=none")
        # scope None is the recipe default, which for the MX recipes is the routed experts.
        if pr.recipe in ("mxfp4_qat", "mxfp8") and any("experts" in pat for pat in pr.scope or ["experts"]):
            bad = {k: v for k, v in (("moe.latent_size", self.moe.latent_size),
                                     ("moe.expert_ffn_size", self.moe.expert_ffn_size)) if v % 32}
            if bad:
                raise ValueError(f"precision.recipe={pr.recipe} quantises expert GEMMs in MX blocks of 32 "
                                 f"along their reduction dims: {bad} must be multiples of 32")
        return self
