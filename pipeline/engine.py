"""Pipeline-parallel engine: runs the interleaved 1F1B schedule over StageIO hops with the
AttnRes block cache, and reproduces the single-process loss and gradients.

Walk-through of one ``train_step(microbatches)`` on pipeline rank r (P ranks, V chunks each,
C = P*V chunks; chunk c lives on rank c % P; hop c is the edge chunk c -> chunk c+1):

1. Plan (static, at construction): ``build_plan`` decides which AttnRes blocks travel on each
   hop and which a rank keeps in its block cache (``pipeline/transport.py``). With the cached
   transport, rank r's chunk c+P already has every block its previous chunk c saw or made,
   so hop c+P-1 carries only the blocks made since.
2. Schedule: ``all_schedules`` turns Megatron's interleaved 1F1B into a list of ops
   ``F``/``B`` (chunk, microbatch) per rank, the same on every rank, so each rank knows
   what its peers send and in which order (``pipeline/schedule.py``; ``simulate`` proves
   the lists cannot deadlock). ``_run`` walks r's list; before each op it posts the receives
   of that op and the next, so transfers overlap compute, and waits only when an op needs
   its input (``pipeline/p2p.py``).
3. Forward F(c, mb): chunk 0 embeds the tokens; any other chunk receives hop c-1's message
   ``[hidden] + blocks`` and makes each tensor a leaf (``requires_grad``), then takes the
   blocks it does not receive from the cache. The last chunk returns the microbatch loss,
   kept for the backward and the mean. Any other chunk's output goes to hop c
   (``_after_forward``), and sent outputs whose data autograd does not need are freed
   (only their ``grad_fn`` is kept, as Megatron's deallocate_output_tensor).
4. Backward B(c, mb), in the schedule's order (the later chunks of a microbatch first): the
   last chunk starts from its loss with gradient 1/m, the mean over microbatches the one-
   process run takes; any other chunk starts from its sent outputs with the gradients hop c
   brought back. After autograd, the gradients of its input leaves go back on hop c-1 (zeros
   for an input nothing used).
5. Graphs (``use_graphs``, CUDA): after the warm-up steps every training F(c, mb) replays the
   forward graph of chunk c's in-flight slot and B(c, mb) its backward graph
   (``pipeline/chunk_graphs.py``); the walk, the cache and every send and receive above stay
   the same, eager, between replays.
6. End: sends are waited for, the loss (mean over microbatches, on the last rank) is
   broadcast over the pipeline group, and, if a ``dp_group`` was given, loss and gradients
   are averaged over it. ``eval_step`` runs the same walk with forward-only schedules,
   without leaves, and empties a microbatch's cache after r's last chunk has run it.

The cached-block gradient rule. A block in rank r's cache is read by several chunks of r
(c, c+P, ...), yet its gradient must reach the producer exactly once. The chunk that put the
block into the cache *owns* its gradient, and gives it up in its own backward, which runs
after the backwards of every later chunk on r that read the block:
* a block chunk c *received* on hop c-1 is cached as the very same leaf chunk c reads, so
  the later chunks' backwards accumulate into that leaf's ``.grad`` next to chunk c's own
  contribution, and chunk c's backward sends the sum upstream with its other input gradients
  (the first chunk to receive a block owns it);
* a block chunk c *produced* is cached as a detached leaf; the later chunks' backwards
  collect their gradients in it, and chunk c's backward adds that gradient to the block's
  output gradient: into hop c's slot when the block also travels on hop c, otherwise as one
  more root of the backward.
Either way the owner then drops its cache entries (their last use). This is why the engine's
gradients match the one-process run, where each block is a single tensor that autograd
accumulates into once per reader.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from pipeline.accounting import CommRecorder, SpanTimer
from pipeline.chunk_graphs import ChunkGraphs, CudaGraph, capture_plan
from pipeline.layout import chunks_of_rank
from pipeline.p2p import MsgKey, PipeComm
from pipeline.schedule import Op, all_schedules
from pipeline.stage_io import StageIO
from pipeline.transport import build_plan


class _SavedStorages:
    """Records the storages autograd saves during a chunk's forward: a sent output whose
    storage is saved (e.g. tanh saves its result) must keep its data for the backward."""

    def __init__(self):
        self.ptrs: set[int] = set()

    def pack(self, t):
        self.ptrs.add(t.untyped_storage().data_ptr())
        return t

    def ctx(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class PipelineEngine:
    """Runs ``train_step`` / ``eval_step`` for this rank's chunks of a C = P*V chunk model.

    Keyword-only arguments:
    local_chunks: global chunk index -> module, exactly the chunks ``c % P == pp_rank``.
        Chunk 0: ``forward(inputs [B, T]) -> StageIO``; middle: ``forward(StageIO) -> StageIO``;
        last: ``forward(StageIO, targets [B, T]) -> loss`` (scalar, mean over the microbatch).
    produced_blocks[c]: global AttnRes block ids chunk c completes (chunk 0: block 0 first).
    pp_group: pipeline process group (ranks ordered by pipeline rank); None means P = 1.
    transport: "cached" (blocks the receiver holds never travel) or "naive" (all blocks travel).
    dp_group: if given, gradients (and the reported loss) are averaged over it after the step.
    recorder: CommRecorder filled with every p2p op and compute span.
    group_size: Megatron's microbatch_group_size_per_vp_stage (default P).
    deallocate_outputs: drop the data of sent outputs the backward does not need (Megatron's
        deallocate_output_tensor); the backward then runs through their grad_fn alone.
    directional_groups: (up, down), two extra process groups with pp_group's ranks, required
        on NCCL (pipeline/p2p.py says why). The caller makes them, as every rank must create
        every group in the same order (k3train makes them in ``k3train.runtime.distributed``); the
        engine creates no process group itself.
    """

    def __init__(self, *, local_chunks: dict[int, nn.Module], num_chunks: int,
                 produced_blocks: list[list[int]], pp_group=None, transport: str = "cached",
                 dp_group=None, recorder: CommRecorder | None = None, group_size: int | None = None,
                 deallocate_outputs: bool = True, directional_groups=None):
        self.P = dist.get_world_size(pp_group) if pp_group is not None else 1
        self.rank = dist.get_rank(pp_group) if pp_group is not None else 0
        if num_chunks % self.P:
            raise ValueError(f"num_chunks={num_chunks} is not a multiple of the pipeline size {self.P}")
        self.C, self.V = num_chunks, num_chunks // self.P
        expected = chunks_of_rank(self.rank, self.P, self.V)
        if sorted(local_chunks) != expected:
            raise ValueError(f"pipeline rank {self.rank} must hold chunks {expected}, got {sorted(local_chunks)}")
        if len(produced_blocks) != num_chunks:
            raise ValueError(f"produced_blocks has {len(produced_blocks)} entries for {num_chunks} chunks")
        self.chunks = local_chunks
        self.plan = build_plan(produced_blocks, self.P, transport)
        self.pp_group, self.dp_group, self.group_size = pp_group, dp_group, group_size
        self.recorder = recorder
        if recorder is not None:
            recorder.rank = self.rank
        self.deallocate_outputs = deallocate_outputs
        params = [p for ch in local_chunks.values() for p in ch.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        if (directional_groups is None and pp_group is not None and self.P > 1
                and dist.get_backend(pp_group) == "nccl"):
            raise ValueError("a pipeline on NCCL needs directional_groups=(up, down): two process "
                             "groups with pp_group's ranks, made by the caller on every rank")
        self.comm = PipeComm(pp_group, self.P, self.rank, self.C, self.plan.hops, recorder, self.device,
                             directional_groups)
        self.peak_cache_bytes = 0
        self.deallocated_outputs = 0          # sent outputs whose data was dropped (cumulative)
        # chunk -> per sent tensor of its hop: whether its data may be dropped after the send
        # (autograd saves neither it nor an alias), learnt at the chunk's first training forward.
        self._droppable: dict[int, tuple[bool, ...]] = {}
        self._schedule_cache: dict[tuple[int, bool], list] = {}
        self.graphs: ChunkGraphs | None = None
        self._graphed = False
        self._reset_state()

    def use_graphs(self, num_microbatches: int, *, warmup: int = 2, graph_factory=CudaGraph,
                   state=None) -> ChunkGraphs:
        """Replay every chunk's training forward and backward from CUDA graphs, one per chunk
        per in-flight slot of this rank's schedule (``pipeline/chunk_graphs.py``), after
        ``warmup`` eager steps; point-to-point stays eager between replays. ``state``: the
        forward-state hooks (``chunk_graphs.StateHooks``). Evaluation stays eager."""
        ops = self._schedules(num_microbatches, forward_only=False)[self.rank]
        self.graphs = ChunkGraphs(chunks=self.chunks, plan=capture_plan(ops), warmup=warmup,
                                  graph_factory=graph_factory, state=state)
        return self.graphs

    # ---- per-step state ---------------------------------------------------------------------
    def _reset_state(self):
        self._cache: dict[int, dict[int, torch.Tensor]] = {}       # mb -> block id -> leaf
        self._cache_bytes = 0
        self._inputs: dict[tuple[int, int], tuple] = {}             # (c, mb) -> (hidden leaf, hop leaves)
        self._outputs: dict[tuple[int, int], object] = {}           # (c, mb) -> sent tensors / loss
        self._produced: dict[tuple[int, int], dict] = {}            # (c, mb) -> block -> (out, leaf)
        self._losses: dict[int, torch.Tensor] = {}

    def _cache_put(self, mb: int, b: int, t: torch.Tensor):
        self._cache.setdefault(mb, {})[b] = t
        self._cache_bytes += t.numel() * t.element_size()
        self.peak_cache_bytes = max(self.peak_cache_bytes, self._cache_bytes)

    def _cache_drop(self, mb: int, blocks):
        entry = self._cache.get(mb, {})
        for b in blocks:
            t = entry.pop(b, None)
            if t is not None:
                self._cache_bytes -= t.numel() * t.element_size()
        if not entry:
            self._cache.pop(mb, None)

    # ---- public API -------------------------------------------------------------------------
    def train_step(self, microbatches: list[tuple]) -> torch.Tensor:
        """Forward and backward of all microbatches; returns the mean loss (same on every rank).

        Each microbatch is ``(inputs [B, T], targets [B, T])``, ``(inputs, targets, segments)``
        with ``segments`` the document boundaries every chunk reads (``StageIO.segments``;
        chunk 0 gets them as ``segments=``; None: none), or ``(inputs, targets, segments,
        loss_tokens)`` with ``loss_tokens`` the divisor the last chunk gets as ``loss_tokens=``
        (context parallelism: each rank's inputs are its slice of every window, and its loss
        is its tokens' summed loss over the whole windows' count). Each rank attaches its own;
        neither is ever sent.

        Parameter ``.grad`` is accumulated as ``d(mean_mb loss_mb)/d param``, as in the
        single-process run; zero the grads before calling.
        """
        m = len(microbatches)
        schedules = self._schedules(m, forward_only=False)
        self._graphed = self.graphs is not None and self.graphs.begin_step(m)
        try:
            self._run(schedules[self.rank], schedules, microbatches, training=True)
        finally:
            if self._graphed:
                self.graphs.end_step()
            self._graphed = False
        loss = self._finish_loss(m)
        if self.dp_group is not None:
            self._average_grads_over_dp()
        return loss

    @torch.no_grad()
    def eval_step(self, microbatches: list[tuple]) -> torch.Tensor:
        """Forward only (no autograd graph); returns the mean loss (same on every rank).
        Microbatches as ``train_step``'s."""
        m = len(microbatches)
        schedules = self._schedules(m, forward_only=True)
        self._run(schedules[self.rank], schedules, microbatches, training=False)
        return self._finish_loss(m)

    # ---- the step -----------------------------------------------------------------------------
    def _schedules(self, m: int, forward_only: bool):
        """Every rank's op list, built once per (m, forward_only): the schedule is static, and
        building it costs host time (~ms at V=4, m=8) that a step should not pay each time."""
        key = (m, forward_only)
        if key not in self._schedule_cache:
            self._schedule_cache[key] = all_schedules(self.P, self.V, m, self.group_size,
                                                      forward_only=forward_only)
        return self._schedule_cache[key]

    def _needs(self, op: Op) -> MsgKey | None:
        if op.kind == "F":
            return MsgKey("fwd", op.chunk - 1, op.microbatch) if op.chunk > 0 else None
        return MsgKey("bwd", op.chunk, op.microbatch) if op.chunk < self.C - 1 else None

    def _receives_ahead(self, needs: list[MsgKey | None]) -> list[tuple[MsgKey, ...]]:
        """Per op: the receives to post before it, its own and the next one from another rank
        that a later op needs (post_until posts every earlier message of that peer's channel)."""
        ahead, nxt = [()] * len(needs), None
        for i in range(len(needs) - 1, -1, -1):
            own = needs[i] if needs[i] is not None and self.comm.is_remote(needs[i]) else None
            ahead[i] = tuple(k for k in (own, nxt if nxt != own else None) if k is not None)
            nxt = own if own is not None else nxt
        return ahead

    def _run(self, ops: list[Op], schedules, microbatches, training: bool):
        self._reset_state()
        if self.recorder is not None:
            self.recorder.new_step()
        self.comm.begin_step(schedules, len(microbatches))
        timer = SpanTimer(self.device) if self.recorder is not None else None
        needs = [self._needs(op) for op in ops]
        ahead = self._receives_ahead(needs)
        for i, op in enumerate(ops):
            # Post the receives up to the next message a later op needs, so its transfer
            # overlaps this op's compute; the wait happens inside recv() when the data is needed.
            for key in ahead[i]:
                self.comm.post_until(key, block=False)
            if timer is not None:
                # Waiting for the op's input is idle time, not compute: it belongs to the bubble.
                if needs[i] is not None:
                    self.comm.wait(needs[i], op.chunk)
                start = timer.mark()
            if op.kind == "F":
                self._forward(op, microbatches[op.microbatch], training)
            else:
                self._backward(op, len(microbatches))
            if timer is not None:
                timer.add(op.kind, op.chunk, op.microbatch, start)
        self.comm.finish_sends()
        if timer is not None:
            for span in timer.spans():
                self.recorder.add_compute(*span)
        self._cache.clear()
        self._record_info(len(microbatches))

    def _forward(self, op: Op, batch, training: bool):
        c, mb = op.chunk, op.microbatch
        inputs, targets, *rest = batch
        segments = rest[0] if rest else None
        seg_kw = {} if segments is None else {"segments": segments}
        loss_kw = {"loss_tokens": rest[1]} if len(rest) > 1 and rest[1] is not None else {}
        chunk = self.chunks[c]
        saved = _SavedStorages()
        # Which sent outputs autograd saves is a property of the chunk's code, not of the data:
        # learnt once per chunk (a Python hook per saved tensor costs host time every op).
        learn = training and self.deallocate_outputs and c != self.C - 1 and c not in self._droppable
        with saved.ctx() if learn else nullcontext():
            if c == 0:
                # One chunk (P = V = 1) is first and last: it takes the tokens and the targets.
                out = (self._call(chunk, c, mb, (inputs, targets), {**seg_kw, **loss_kw}) if self.C == 1
                       else self._call(chunk, c, mb, (inputs,), seg_kw))
            else:
                tensors = self.comm.recv(MsgKey("fwd", c - 1, mb), c)
                has_hidden = self.comm.has_hidden[c - 1]
                if training:
                    for t in tensors:
                        t.requires_grad_()
                hidden = tensors[0] if has_hidden else None
                hop_blocks = dict(zip(self.plan.hops[c - 1], tensors[int(has_hidden):]))
                cached = {b: self._cache[mb][b] for b in self.plan.from_cache[c]}
                blocks = dict(sorted({**cached, **hop_blocks}.items()))
                # Received blocks a later chunk on this rank reads go into the cache as the very
                # same leaf: the later chunks' backward accumulates into its .grad, which this
                # chunk's backward then sends back (the "first received" owner rule).
                for b in self.plan.cache_after[c]:
                    if b in hop_blocks:
                        self._cache_put(mb, b, hop_blocks[b])
                if training:
                    self._inputs[(c, mb)] = (hidden, hop_blocks)
                io = StageIO(hidden, blocks, segments)
                last = c == self.C - 1
                out = self._call(chunk, c, mb, (io, targets) if last else (io,), loss_kw if last else None)
        if c == self.C - 1:
            self._losses[mb] = out.detach()
            if training:
                self._outputs[(c, mb)] = out
        else:
            self._after_forward(c, mb, out, training, saved)
        if not training and c + self.P >= self.C:      # last local chunk: the cache is done
            self._cache_drop(mb, list(self._cache.get(mb, {})))

    def _call(self, chunk: nn.Module, c: int, mb: int, args: tuple, kwargs: dict | None = None):
        """The chunk's forward: replayed from its slot's graph in a graphed training step.
        ``kwargs``: chunk 0's document segments (replayed as a static input: they must come in
        one fixed shape), the last chunk's loss divisor (context parallelism, which graphs do
        not serve: ``RunConfig.cuda_graph_blockers``)."""
        if self._graphed:
            if set(kwargs or {}) - {"segments"}:
                raise ValueError(f"chunk graphs cannot replay {sorted(set(kwargs) - {'segments'})} "
                                 f"(context parallelism's loss divisor is not captured)")
            return self.graphs.forward(c, mb, args, kwargs)
        return chunk(*args, **(kwargs or {}))

    def _after_forward(self, c: int, mb: int, out: StageIO, training: bool, saved: _SavedStorages):
        if not isinstance(out, StageIO):
            raise TypeError(f"chunk {c} returned {type(out).__name__}, expected StageIO")
        missing = set(self.plan.available[c]) - set(out.blocks)
        if missing:
            raise KeyError(f"chunk {c} output lacks blocks {sorted(missing)}; its blocks must hold "
                           f"every block produced so far {list(self.plan.available[c])}")
        produced = {}
        for b in self.plan.cache_after[c]:
            if b in self.plan.produced[c]:
                # Later local chunks get a detached leaf; their backward deposits into its .grad
                # and this chunk's backward adds the deposit to the block's output gradient.
                leaf = out.blocks[b].detach().requires_grad_(training)
                self._cache_put(mb, b, leaf)
                produced[b] = (out.blocks[b], leaf)
        has_hidden = out.hidden is not None
        tensors = ([out.hidden] if has_hidden else []) + [out.blocks[b] for b in self.plan.hops[c]]
        self.comm.send(MsgKey("fwd", c, mb), tensors, c, has_hidden)
        if not training:
            return
        self._outputs[(c, mb)] = tensors
        self._produced[(c, mb)] = produced
        if self.deallocate_outputs:
            drop = self._droppable.get(c)
            if drop is None:
                ids = [id(t) for t in tensors]
                drop = self._droppable[c] = tuple(
                    t.grad_fn is not None and ids.count(id(t)) == 1
                    and t.untyped_storage().data_ptr() not in saved.ptrs for t in tensors)
            for t, d in zip(tensors, drop):
                if d:
                    # The send owns its own reference to the data; the graph only needs grad_fn.
                    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)
                    self.deallocated_outputs += 1

    def _backward(self, op: Op, num_microbatches: int):
        c, mb = op.chunk, op.microbatch
        if c == self.C - 1:
            loss = self._outputs.pop((c, mb))
            # d(mean over microbatches)/d loss_mb: the single-process reference averages losses.
            roots, grads = [loss], [torch.full_like(loss, 1.0 / num_microbatches)]
        else:
            roots = self._outputs.pop((c, mb))
            has_hidden = self.comm.has_hidden[c]
            grads = self.comm.recv(MsgKey("bwd", c, mb), c)
            roots, grads = list(roots), list(grads)
            for b, (out_b, leaf) in self._produced.pop((c, mb), {}).items():
                if leaf.grad is None:
                    continue
                if b in self.plan.hops[c]:
                    i = int(has_hidden) + self.plan.hops[c].index(b)
                    grads[i] = grads[i] + leaf.grad
                else:
                    roots.append(out_b)
                    grads.append(leaf.grad)
        pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
        if pairs:
            # The engine call skips autograd's shape check, which deallocated outputs would fail;
            # grad_fn still knows the true shapes (as Megatron's custom_backward).
            Variable._execution_engine.run_backward(
                tuple(r for r, _ in pairs), tuple(g for _, g in pairs), keep_graph=False,
                create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True)
        if c > 0:
            hidden, hop_blocks = self._inputs.pop((c, mb))
            ins = ([hidden] if hidden is not None else []) + [hop_blocks[b] for b in self.plan.hops[c - 1]]
            gin = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]
            self.comm.send(MsgKey("bwd", c - 1, mb), gin, c)
        # This chunk owns the cache entries it received or produced: their last use was above.
        self._cache_drop(mb, self.plan.cache_after[c])

    # ---- end of step ------------------------------------------------------------------------
    def _finish_loss(self, m: int) -> torch.Tensor:
        if self.rank == self.P - 1:
            loss = torch.stack([self._losses[i] for i in range(m)]).mean().float()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.pp_group is not None:
            dist.broadcast(loss, self.comm.global_ranks[self.P - 1], group=self.pp_group)
        if self.dp_group is not None:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= dist.get_world_size(self.dp_group)
        self._losses.clear()
        return loss

    def _average_grads_over_dp(self):
        n = dist.get_world_size(self.dp_group)
        for c in sorted(self.chunks):
            for p in self.chunks[c].parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.dp_group)
                    p.grad /= n

    def _record_info(self, m: int):
        if self.recorder is None:
            return
        specs = self.comm.specs
        block_bytes = next((s[0].nbytes for s in specs.values() if s), 0)
        self.recorder.info = {
            "plan": self.plan, "pp_size": self.P, "vpp_size": self.V, "num_microbatches": m,
            "block_bytes": block_bytes,
            "has_hidden": {c: h for c, h in self.comm.has_hidden.items()},
            "peak_cache_bytes": {self.rank: self.peak_cache_bytes},
        }
