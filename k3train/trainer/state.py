"""What a rank trains: its model part, optimizer, balancers, and the step itself."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from k3train.errors import UsageError
from k3train.config import RunConfig
from k3train.runtime.distributed import ParallelContext, ParallelInfo, parallel_context
from k3train.data.documents import WindowDocuments, max_documents
from k3train.model.info import count_parameters
from k3train.ops import kernels
from k3train.ops.context_parallel import cp_token_index
from k3train.model.forward_state import forward_state_holders
from k3train.model.model import moe_layer_indices
from k3train.ops.triton_compile import compile_ahead
from k3train.trainer.cuda_graph import (CapturedDocuments, ChunkForwardState, GraphedForwardBackward,
                                        PaddedDocuments)
from k3train.trainer.moe_stats import MoEStats
from k3train.trainer.optimizer import build_k3_optimizer
from k3train.trainer.parts import build_parts
from moe import Balancer
from optim import DataParallelGrads, GradGroups, apply_lr, lr_factor
from optim.grads import allreduce_mean
from pipeline import CommRecorder
from pipeline.chunk_graphs import CudaGraph, no_graphs


def autocast_for(cfg: RunConfig, device: torch.device, graph: bool = False):
    """The step's autocast context: bf16 on CUDA unless ``precision.recipe=fp32``; none on CPU.
    Without the weight-cast cache when the step is CUDA-graphed (a cached cast would be recorded)."""
    if device.type == "cuda" and cfg.precision.recipe != "fp32":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not graph)
    return contextlib.nullcontext()


def _autocast_off(region):
    """Autocast disabled inside an autocast ``region`` (a nested context: leaving it does not
    clear the region's weight-cast cache); nothing where the region is no autocast."""
    if isinstance(region, torch.autocast):
        return torch.autocast(region.device, enabled=False)
    return contextlib.nullcontext()


def use_cuda_graph(cfg: RunConfig, info: ParallelInfo, device: torch.device) -> bool:
    """``train.cuda_graph`` resolved for this run: false, "auto" (on exactly when supported) or
    true (on; raises naming what stops it). ``RunConfig.cuda_graph_blockers`` is the one list of
    blockers; the config check already refused true for those it can see, the device is only
    known here."""
    want = cfg.train.cuda_graph
    if want is False:
        return False
    if want == "auto":
        return device.type == "cuda" and not cfg.cuda_graph_blockers(device=device.type, auto=True)
    refusal = cfg.cuda_graph_refusal(device=device.type)
    if refusal is not None:
        raise UsageError(refusal)
    return True


def _segments(cu_seqlens: torch.Tensor | None) -> dict:
    """The model's ``segments=`` keyword when a batch has document boundaries, else nothing (the
    call is then the one it was before document masking)."""
    return {} if cu_seqlens is None else {"segments": cu_seqlens}


def _window_loss(state, windows: torch.Tensor) -> torch.Tensor:
    """``state``'s model's loss on ``windows`` [B, T+1] (pp = 1), or under context parallelism
    this rank's share of it (``_cp_slice``). Reads ``state.model``, ``targets``, ``documents``,
    ``cp`` (and ``cp_rank`` when cp > 1)."""
    inputs, targets, segments = windows[:, :-1], state.targets(windows), state.documents(windows)
    if state.cp > 1:  # the mixers read the whole windows' boundaries (k3train.model.cp_documents)
        x, t, seg, divisor = _cp_slice(inputs, targets, segments, state.cp, state.cp_rank, state.cp_partition)
        return state.model(x, t, segments=seg, loss_tokens=divisor)
    return state.model(inputs, targets, **_segments(segments))


def engine_microbatch(state, windows: torch.Tensor, documents=None) -> tuple:
    """The pipeline engine's microbatch for ``windows`` [B, T+1] (``PipelineEngine.train_step``):
    ``(inputs, targets, segments)``, or under context parallelism this rank's slice of them and
    the loss divisor (``_cp_slice``): every stage slices alike, so each hop carries one CP
    rank's tokens to the same CP rank of the next stage. Reads ``state.targets``,
    ``documents`` (unless ``documents`` is given), ``cp`` and ``cp_rank``."""
    documents = documents if documents is not None else state.documents
    inputs, targets, segments = windows[:, :-1], state.targets(windows), documents(windows)
    if state.cp > 1:
        return _cp_slice(inputs, targets, segments, state.cp, state.cp_rank, state.cp_partition)
    return inputs, targets, segments


def _cp_slice(inputs: torch.Tensor, targets: torch.Tensor, segments, cp: int, rank: int,
              partition: str = "contiguous") -> tuple:
    """CP rank ``rank``'s share of every window, ``[B, T / cp]`` inputs and targets (its
    ``partition`` pieces in local order, ``cp_token_index``: targets are sliced at the same
    positions as the inputs, so a piece's last token keeps the next global token as its label),
    the whole windows' document boundaries (``segments``, unchanged: the mixers map them to the
    rank's positions, ``k3train.model.cp_documents``), and the loss divisor that makes the loss
    exact: the window's loss is the sum of token losses over its N target tokens (all CP ranks;
    -100 ignored) divided by N, so each rank returns ``cp * (its sum) / N``; averaged over
    DP x CP with the gradients, that is the mean over DP of each window's exact loss, also when
    the ranks' slices hold different numbers of target tokens. The count is taken on the whole
    window, so no exchange."""
    n = inputs.shape[1] // cp
    mine = slice(rank * n, (rank + 1) * n) if partition == "contiguous" else \
        cp_token_index(inputs.shape[1], rank, cp, partition, device=inputs.device)
    counted = (targets != -100).sum().clamp(min=1)  # an all-ignored window trains nothing
    return inputs[:, mine], targets[:, mine], segments, counted / cp


class TrainState:
    """The model part, optimizer and per-step logic of one rank (TP, PP and DP aware)."""

    def __init__(self, cfg: RunConfig, info: ParallelInfo, device: torch.device,
                 recorder: CommRecorder | None = None, targets=None,
                 parallel: ParallelContext | None = None, documents=None):
        """targets: windows [B, T+1] -> loss targets [B, T] (default: every next token; MQAR
        masks all but the recalled values with -100). parallel: this rank's groups (default:
        made from ``info`` by ``k3train.runtime.distributed.parallel_context``, collective).
        documents: windows [B, T+1] -> the inputs' document boundaries (``cu_seqlens``) or None
        (``RunData.documents``; default: none, one sequence per window)."""
        self.cfg, self.info, self.device = cfg, info, device
        self.parallel = parallel if parallel is not None else parallel_context(
            info, p2p_backend=cfg.pipeline.p2p_backend)
        ctx = self.parallel
        self.targets = targets if targets is not None else (lambda w: w[:, 1:])
        self.documents = documents if documents is not None else (lambda w: None)
        # pp=1: the whole model; otherwise this rank's chunks, driven by the pipeline engine.
        self.model, self.engine = build_parts(cfg, device, ctx, recorder)
        self.pp_group = ctx.pp_group if info.pp > 1 else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.balancer = Balancer(cfg.moe.balancing, cfg.moe.aux_free_rate)
        self.moe_layers = self.model.moe_layers()
        self.dp_group = ctx.dp_group
        # Context parallelism: every CP rank of a DP replica reads the same windows and trains
        # its pieces of each (``_cp_slice``, parallel.cp_partition); the loss, the gradients and the router
        # statistics are then averaged over DP x CP (the DP group itself at cp = 1).
        self.cp, self.cp_rank = info.cp, ctx.cp_rank
        self.cp_partition = cfg.parallel.cp_partition
        self.loss_group = ctx.dp_cp_group if info.cp > 1 else ctx.dp_group
        self.loss_ranks = info.dp * info.cp
        self.moe_stats = self._build_moe_stats()
        self.tp_group = ctx.tp_group
        # Expert weights are sharded over EP: reduced over the expert-data-parallel replicas only.
        expert_params = [p for layer in self.moe_layers for p in layer.experts.parameters()]
        self.ep_group = ctx.ep_group if info.ep > 1 else None
        self.edp_group = ctx.edp_group
        groups = GradGroups(dp=self.loss_group, expert_dp=self.edp_group, tp=self.tp_group,
                            ep=self.ep_group, pp=self.pp_group)
        self.sharded = cfg.optim.zero1
        self.optimizer, self.param_table = build_k3_optimizer(
            self.model, cfg.optim, groups=groups, expert_params=expert_params, precision=cfg.precision)
        # The one gradient path (optim.grads): ZeRO-1 reduces, norms and clips its owned parts,
        # the replicated optimizer's gradients go through DataParallelGrads; same convention
        # (bf16 weights: the optimizer reduces its fp32 main gradients itself).
        self.grads = (self.optimizer if getattr(self.optimizer, "reduces_gradients", False) else
                      DataParallelGrads(self.params, groups=groups, expert_params=expert_params))
        self._bytes_logged = 0
        graph = use_cuda_graph(cfg, info, device)
        self.autocast = autocast_for(cfg, device, graph)
        # One graph of the whole step on one pipeline stage; under pipeline parallelism the
        # engine replays one graph per chunk per in-flight microbatch and keeps p2p eager.
        accepts = None
        if graph and self.engine is None and isinstance(documents, WindowDocuments):
            # the fixed-shape form a graph can record (RunData.documents of masked text runs)
            self.documents = CapturedDocuments(documents, cfg.train.microbatches)
            accepts = self.documents.fits
        self.graphed = (GraphedForwardBackward(self._forward_backward, self.params,
                                               forward_state_holders(self.model), accepts=accepts)
                        if graph and self.engine is None else None)
        if graph and self.engine is not None:
            self.use_chunk_graphs()
        self.graph_words = self._graph_words(graph)

    def use_chunk_graphs(self, graph_factory=CudaGraph, warmup: int = 2) -> None:
        """Replay the pipeline engine's chunks from graphs (``PipelineEngine.use_graphs``; the
        CPU tests pass ``EagerGraph``). Under document masking every microbatch's boundaries
        come in the fixed shape the graphs record (``PaddedDocuments``)."""
        if isinstance(self.documents, WindowDocuments):
            self.documents = PaddedDocuments(self.documents, self.cfg.train.microbatches)
        self.engine.use_graphs(self.cfg.train.microbatches, warmup=warmup, graph_factory=graph_factory,
                               state=ChunkForwardState(self.engine.chunks))

    def _graph_words(self, on: bool) -> str:
        """What ``train.cuda_graph`` resolved to and why, for the banner."""
        want = self.cfg.train.cuda_graph
        if on and self.engine is not None:
            plan = self.engine.graphs.plan
            docs = ""
            if isinstance(self.documents, PaddedDocuments):
                t = self.cfg.train
                docs = (f"; document boundaries in a fixed shape of {max_documents(t.micro_batch_size, t.seq_len)} "
                        f"documents per microbatch (a step with a microbatch holding more runs eagerly)")
            return (f"on (train.cuda_graph={want}): {plan.graphs} chunk graphs on this rank, one forward "
                    f"and one backward per chunk per in-flight microbatch, from step 3{docs}")
        if on and isinstance(self.documents, CapturedDocuments):
            t = self.cfg.train
            return (f"on (train.cuda_graph={want}): the whole forward/backward, from step 3; document "
                    f"boundaries recorded in a fixed shape of {max_documents(t.micro_batch_size, t.seq_len)} "
                    f"documents per microbatch (a microbatch with more runs that step eagerly)")
        if on:
            return f"on (train.cuda_graph={want}): the whole forward/backward, from step 3"
        if want is False:
            return "off (train.cuda_graph=false)"
        blockers = self.cfg.cuda_graph_blockers(device=self.device.type, auto=True)
        return f"off (train.cuda_graph=auto): {next(iter(blockers.values()))}"

    def describe(self) -> str:
        chunks = list(self.model.values()) if self.engine is not None else [self.model]
        per_chunk = [count_parameters(c, self.cfg.moe.topk, self.cfg.moe.num_experts) for c in chunks]
        counts = {k: sum(c[k] for c in per_chunk) for k in ("total", "activated")}
        return (f"{counts['total'] / 1e6:.2f}M parameters on this rank "
                f"({counts['activated'] / 1e6:.2f}M activated per token), optimizer {self.cfg.optim.name}")

    def schedule_lr(self, step: int) -> float:
        """Sets the optimizer's learning rate for training step ``step`` (1-based) as the config
        schedules it (``optim.lr``, ``optim.schedule`` with ``optim.warmup_steps`` over
        ``train.steps``) and returns it. ``train_step`` leaves the rate alone: the trainer's
        loop calls this before every step, and so must anything else that trains (a benchmark
        that skips it trains at the full rate from step 1, with no warm-up)."""
        o, steps = self.cfg.optim, self.cfg.train.steps
        # min(): a short run (train.steps=5) with the default warm-up keeps working.
        factor = lr_factor(step - 1, steps, min(o.warmup_steps, steps), o.schedule, o.min_lr_ratio)
        apply_lr(self.optimizer, factor)
        return o.lr * factor

    def train_step(self, batch: torch.Tensor, poison: bool = False) -> dict:
        """batch: LongTensor [micro_batch_size * microbatches, seq_len + 1] for this DP rank.
        poison: make the loss NaN (fault-injection tests of the skip logic)."""
        if self.graphed is not None and not poison:
            total = self.graphed(batch)
        else:
            total = self._forward_backward(batch, poison)
        allreduce_mean([total], self.loss_group, self.loss_ranks)
        self.grads.reduce_grads()
        norm = self.grads.global_grad_norm()
        # One host read per step: the skip decision must be known before the update. Whether
        # clipping scales anything (the clip factor < 1) comes in the same read, so unclipped
        # steps skip a pass over every gradient.
        max_norm = self.cfg.train.grad_clip
        finite, clips = torch.stack([torch.isfinite(norm) & torch.isfinite(total),
                                     norm + 1e-6 > max_norm]).tolist()
        if finite:
            if clips:
                self.grads.clip_grads_(norm, max_norm)
            self.optimizer.step()
            self._balance()
        if self.moe_stats is not None:
            self.moe_stats.end_step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": total.item(), "grad_norm": norm.item(), "finite": finite}

    def _forward_backward(self, batch: torch.Tensor, poison: bool = False) -> torch.Tensor:
        """Forward and backward of every microbatch of ``batch``; returns the mean loss (a scalar
        on the device). Gradients accumulate in ``.grad``; nothing is reduced or stepped."""
        m = self.cfg.train.microbatches
        # Chunk graphs with document masking: a step with a microbatch holding more documents
        # than the recorded shape runs eagerly, with its exact boundaries (read on the host,
        # before the batch is copied to the device).
        exact = (self.documents.exact if isinstance(self.documents, PaddedDocuments)
                 and not self.documents.fits(batch) else None)
        batch = batch.to(self.device, non_blocking=True)
        self.model.train()
        if self.engine is not None:
            with self.autocast, no_graphs(self.engine.graphs) if exact is not None else contextlib.nullcontext():
                total = self.engine.train_step([engine_microbatch(self, mb, exact) for mb in batch.chunk(m)])
            total = total * float("nan") if poison else total
        else:
            total = torch.zeros((), device=self.device)
            # One autocast region around all microbatches, so that autocast's cache can serve a
            # weight's bf16 cast to every microbatch (it casts leaf, non-view weights once per
            # region); each backward runs with autocast off, as outside the region (the nesting
            # keeps the cache alive). On the K3 slice's H200 step it changed no measured copy
            # count or time (benchmarks/README.md).
            with self.autocast:
                for mb in batch.chunk(m):
                    loss = _window_loss(self, mb)
                    if poison:
                        loss = loss * float("nan")
                    with _autocast_off(self.autocast):
                        (loss / m).backward()
                    total += loss.detach() / m
        return total

    def compile_kernels(self) -> dict | None:
        """Compile the step's Triton kernels (fla's, on CUDA) all at once, before step 1.

        Runs one throwaway forward/backward with every Triton launch turned into a parallel
        compile (``k3train.ops.triton_compile``) on a batch of the step's shape, and the
        optimizer's kernels on scratch tensors of its shapes (``warm_kernels``) and one
        validation forward (``evaluate``, no grad), then drops the gradients and routing: weights, optimizer and balancer state are untouched. Without it
        the kernels and their autotune candidates compile one at a time inside step 1. Every
        rank must call it (pipeline and expert-parallel hops run as in a real step). Returns
        the compile stats, or None where there is nothing to compile (CPU, torch kernels)."""
        if not kernels.uses_triton(self.device):
            return None
        cfg = self.cfg.train
        batch = torch.zeros(cfg.micro_batch_size * cfg.microbatches, cfg.seq_len + 1, dtype=torch.long)
        def step_kernels():
            loss = self._forward_backward(batch)
            # The optimizer's kernels too (Muon's Newton-Schulz GEMM, one compile and autotune
            # per matrix shape): left out, they compiled one by one in step 1.
            warm = getattr(self.optimizer, "warm_kernels", None)
            if warm is not None:
                warm()
            # The validation pass's forward too (no grad, eval mode, a batch of its shape): its
            # kernels compiled at the first evaluation otherwise (about 93 s of a fresh k3_mini
            # run on an H200, issue 40). Under the pipeline as many microbatches as a step has
            # (a forward-only schedule the engine runs for any step's count).
            self.evaluate([batch[:cfg.micro_batch_size]] * (cfg.microbatches if self.engine is not None else 1))
            return loss

        with no_graphs(self.engine.graphs if self.engine is not None else None):
            stats = compile_ahead(step_kernels, label="the training step")
        self.optimizer.zero_grad(set_to_none=True)
        for layer in self.moe_layers:
            layer.routing.clear()
        if self.engine is not None:
            self._bytes_logged = self.engine.comm.bytes_sent
        return stats

    @torch.no_grad()
    def _balance(self) -> None:
        """Update router biases from this step's routing (all microbatches), agreeing over DP."""
        group = self.loss_group if self.loss_ranks > 1 else None
        for layer in self.moe_layers:
            self.balancer.update(layer, group)
        if self.moe_stats is not None:
            self.moe_stats.record_step()

    def _build_moe_stats(self) -> MoEStats | None:
        """The load statistics of the run (None for a model without MoE layers); under
        pipeline parallelism a rank may hold none of them but still joins the gathers."""
        every = moe_layer_indices(self.cfg)
        if not every:
            return None
        return MoEStats(layers=self.moe_layers, rows=[every.index(i) for i in self.model.moe_layer_indices()],
                        num_moe_layers=len(every), num_experts=self.cfg.moe.num_experts,
                        dp_group=self.loss_group, dp=self.loss_ranks, pp_group=self.pp_group,
                        device=self.device)

    def moe_metrics(self) -> dict:
        """The last step's ``moe/*`` metrics of the whole model (collective over the pipeline)."""
        return self.moe_stats.metrics() if self.moe_stats is not None else {}

    def pipeline_metrics(self) -> dict:
        """Bytes this rank sent to pipeline peers since the last call, and its peak AttnRes cache."""
        if self.engine is None:
            return {}
        sent = self.engine.comm.bytes_sent
        delta, self._bytes_logged = sent - self._bytes_logged, sent
        return {"pipeline/bytes_sent": delta, "pipeline/peak_cache_bytes": self.engine.peak_cache_bytes}

    def cp_metrics(self) -> dict:
        """Bytes this rank sent in context-parallel exchanges since the last call (forward,
        backward and recomputed forwards; ``k3train.ops.context_parallel.CPCommLog``)."""
        log = getattr(self.model, "cp_log", None)
        if log is None:
            return {}
        sent = log.total()
        log.records.clear()
        return {"cp/bytes_sent": sent}

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        self.model.eval()
        if self.engine is not None:
            with self.autocast:
                # Evaluation is never graphed: the exact boundaries (any number of documents).
                docs = self.documents.exact if isinstance(self.documents, PaddedDocuments) else None
                loss = self.engine.eval_step([engine_microbatch(self, b.to(self.device), docs) for b in batches])
        else:
            losses = []
            for b in batches:
                b = b.to(self.device)
                with self.autocast:
                    losses.append(_window_loss(self, b).float())
            loss = torch.stack(losses).mean()
        if self.cp > 1:  # each CP rank holds its share of every window's loss (``_cp_slice``)
            dist.all_reduce(loss, group=self.parallel.cp_group)
            loss = loss / self.cp
        return loss.item()

    def state_dict(self, step: int) -> dict:
        return {"step": step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "moe_loads": self.moe_stats.state_dict() if self.moe_stats is not None else None,
                "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}

    def load_state_dict(self, state: dict) -> int:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.moe_stats is not None and state.get("moe_loads") is not None:
            self.moe_stats.load_state_dict(state["moe_loads"])  # checkpoints before it lack it
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"])
        return int(state["step"])
