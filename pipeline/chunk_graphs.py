"""CUDA graphs for the pipeline engine: one forward and one backward graph per chunk per
in-flight microbatch slot, replayed in schedule order, with point-to-point kept eager.

Why per slot. Under 1F1B a chunk has several microbatches in flight (forward done, backward
not yet): each needs its own saved activations until its backward. A graph replays at fixed
addresses, so one graph per chunk would overwrite the activations of the microbatch still
waiting for its backward. ``capture_plan`` walks a rank's schedule and gives each forward the
lowest slot no in-flight microbatch of that chunk holds; the slot is free again at that
microbatch's backward. The plan is data (``CapturePlan``): the CPU tests check it against the
schedule, as ``pipeline.schedule.simulate`` checks the op lists.

Memory. Each slot's two graphs capture into the slot's own memory pool. The backward graph
frees the slot's saved activations when it ends (``torch.compile``'s backward reuses them in
place, which rules out keeping the autograd graph), so the pool holds them only between the
slot's forward and backward; a pool shared with another slot could give that memory to a
graph that replays while this slot's activations are live. One pool per slot costs each
slot its own temporaries on top of its activations; peak memory is then the eager engine's
(one set of activations per in-flight microbatch) plus those temporaries. The tensors that
live across graphs (static inputs, outputs, output and input gradients) stay referenced for
the whole run.

What a replay does (``ChunkGraphs.forward``): copy the chunk's inputs (the hop's tensors, the
cached AttnRes blocks, tokens, targets, and the microbatch's document boundaries in their fixed
shape, so that one recording serves every batch's documents) into the slot's static inputs, replay the forward
graph, and return *copies* of the outputs (an output may sit in a send or the block cache
while the slot's next forward replays; a copy of a ``[B, T, D]`` hidden state costs
microseconds). The outputs carry an autograd node whose backward copies the incoming gradients
into the slot's static buffers, replays the backward graph and returns copies of the input
gradients: the engine's schedule, block-cache gradient rule and sends are unchanged.
Parameter gradients are summed inside the backward graph into one persistent buffer per
parameter (``main_grads``, zeroed at each step's start and handed to ``.grad`` at its end),
so accumulating over microbatches launches nothing.

Capture happens at a slot's first use in the first graphed step: the forward is captured, the
backward captured right after it into the same pool, then both replay on the real data. Earlier steps run eagerly (``warmup``) so that
Triton autotuning, ``torch.compile`` and the allocator settle first. Forward state (MoE
routing records read after the step) is handled by the caller's ``state`` hooks.

``graph_factory`` makes the graph objects: ``torch.cuda.CUDAGraph`` on a GPU; the CPU tests
pass ``EagerGraph``, which re-runs the recorded body at every replay, so the slot logic,
static buffers, main-gradient accumulation and state hooks run through the same code on CPU.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from pipeline.schedule import Op
from pipeline.stage_io import StageIO


# ---- the capture plan -----------------------------------------------------------------------
@dataclass(frozen=True)
class CapturePlan:
    """Which graphs one pipeline rank captures.

    slots: chunk -> the slot of each microbatch (``slots[c][mb]``).
    num_slots: chunk -> how many slots (the most microbatches of the chunk in flight at once).
    lifetimes: (chunk, microbatch) -> (index of its F op, index of its B op) in the rank's list.
    Each slot's two graphs share one memory pool, the slot's own (module docstring): ``graphs``
    counts what is captured (two per slot), ``pools`` the memory pools (one per slot).
    """

    slots: dict[int, tuple[int, ...]]
    num_slots: dict[int, int]
    lifetimes: dict[tuple[int, int], tuple[int, int]]

    @property
    def graphs(self) -> int:
        return 2 * sum(self.num_slots.values())

    @property
    def pools(self) -> int:
        return sum(self.num_slots.values())


def capture_plan(ops: list[Op]) -> CapturePlan:
    """The plan of one rank from its training op list (``all_schedules(...)[rank]``): each
    forward takes the lowest slot its chunk has free, each backward frees its microbatch's."""
    held: dict[int, dict[int, int]] = {}          # chunk -> slot -> microbatch in flight
    slot_of: dict[tuple[int, int], int] = {}
    start: dict[tuple[int, int], int] = {}
    lifetimes: dict[tuple[int, int], tuple[int, int]] = {}
    num_slots: dict[int, int] = {}
    for i, op in enumerate(ops):
        key = (op.chunk, op.microbatch)
        busy = held.setdefault(op.chunk, {})
        if op.kind == "F":
            slot = next(s for s in range(len(busy) + 1) if s not in busy)
            busy[slot] = op.microbatch
            slot_of[key], start[key] = slot, i
            num_slots[op.chunk] = max(num_slots.get(op.chunk, 0), slot + 1)
        elif op.kind == "B":
            if key not in slot_of:
                raise ValueError(f"backward of chunk {op.chunk} microbatch {op.microbatch} before its forward")
            del busy[slot_of[key]]
            lifetimes[key] = (start[key], i)
        else:
            raise ValueError(f"unknown op kind {op.kind!r}")
    slots = {}
    for c in sorted(num_slots):
        mbs = sorted(mb for (cc, mb) in slot_of if cc == c)
        if mbs != list(range(len(mbs))):
            raise ValueError(f"chunk {c} runs microbatches {mbs}, expected 0..{len(mbs) - 1}")
        slots[c] = tuple(slot_of[(c, mb)] for mb in mbs)
    return CapturePlan(slots=slots, num_slots=num_slots, lifetimes=lifetimes)


# ---- graph objects --------------------------------------------------------------------------
class Graph(Protocol):
    """What ``ChunkGraphs`` needs of a graph: record a body once, replay it later. ``pool``:
    the memory pool the recording allocates from (None on CPU)."""

    def record(self, body: Callable[[], None], pool) -> None: ...
    def replay(self) -> None: ...


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the ``Graph`` protocol: ``record`` captures ``body`` (its
    kernels do not run), ``replay`` launches them."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def record(self, body: Callable[[], None], pool) -> None:
        with torch.cuda.graph(self.graph, pool=pool):
            body()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A stand-in with the same protocol that runs ``body`` at every replay (none at record):
    the CPU path through the same slots and buffers (the tests' reference)."""

    def record(self, body: Callable[[], None], pool) -> None:
        self.body = body

    def replay(self) -> None:
        # The replay is called inside the autograd node (grad mode off there); the body was
        # recorded with grad on, as a CUDA capture records it.
        with torch.enable_grad():
            self.body()


# ---- flattening of the engine's chunk arguments -----------------------------------------------
def _flatten(obj, *, segments: bool = True) -> tuple[list[torch.Tensor], tuple]:
    """StageIO | Tensor -> (tensors, spec); ``_unflatten`` inverts it. A StageIO's document
    boundaries (``segments``, a fixed-shape LongTensor under graphs) are one more static input;
    ``segments=False`` leaves them out (a chunk's outputs: the engine attaches its own copy to
    what the next chunk receives, and never sends them)."""
    if isinstance(obj, StageIO):
        seg = segments and obj.segments is not None
        tensors = (([obj.hidden] if obj.hidden is not None else []) + list(obj.blocks.values())
                   + ([obj.segments] if seg else []))
        return tensors, ("io", obj.hidden is not None, tuple(obj.blocks), seg)
    if isinstance(obj, torch.Tensor):
        return [obj], ("t",)
    raise TypeError(f"a graphed chunk takes and returns StageIO or tensors, got {type(obj).__name__}")


def _unflatten(tensors: list[torch.Tensor], spec: tuple):
    if spec[0] == "t":
        return tensors[0]
    _, has_hidden, blocks, seg = spec
    hidden = tensors[0] if has_hidden else None
    n = int(has_hidden) + len(blocks)
    return StageIO(hidden, dict(zip(blocks, tensors[int(has_hidden):n])), tensors[n] if seg else None)


def _flatten_args(args: tuple, kwargs: dict | None = None) -> tuple[list[torch.Tensor], list[tuple]]:
    """A chunk call's positional and keyword arguments (tensors or StageIO) -> (tensors, specs);
    each spec is (keyword or None, the argument's spec, how many tensors it took)."""
    flat, specs = [], []
    for key, a in [(None, a) for a in args] + sorted((kwargs or {}).items()):
        tensors, spec = _flatten(a)
        flat += tensors
        specs.append((key, spec, len(tensors)))
    return flat, specs


def _unflatten_args(flat: list[torch.Tensor], specs: list[tuple]) -> tuple[tuple, dict]:
    args, kwargs, i = [], {}, 0
    for key, spec, n in specs:
        value = _unflatten(flat[i:i + n], spec)
        if key is None:
            args.append(value)
        else:
            kwargs[key] = value
        i += n
    return tuple(args), kwargs


# ---- one slot's graphs and the autograd node that replays them --------------------------------
class _Slot:
    """Static buffers and the two graphs of one (chunk, slot)."""

    def __init__(self, chunk: int, slot: int):
        self.chunk, self.slot = chunk, slot
        self.fwd: Graph | None = None
        self.bwd: Graph | None = None
        self.static_in: list[torch.Tensor] = []
        self.arg_specs: list[tuple] = []
        self.outs: list[torch.Tensor] = []          # the forward body's outputs (autograd roots)
        self.out_spec: tuple = ()
        self.grad_out: list[torch.Tensor | None] = []
        self.grad_in: list[torch.Tensor | None] = []
        self.reached: list[nn.Parameter] = []      # parameters the backward gives a gradient
        self.state = None                           # what the caller's state hook kept at capture


class _Replay(torch.autograd.Function):
    """Forward: copy inputs in, replay the forward graph, return copies of the outputs.
    Backward: copy output gradients in, replay the backward graph, return copies of the input
    gradients (parameter gradients are already summed into the main gradients)."""

    @staticmethod
    def forward(ctx, slot: _Slot, anchor: torch.Tensor, *inputs: torch.Tensor):
        for static, x in zip(slot.static_in, inputs):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        slot.fwd.replay()
        ctx.slot = slot
        return tuple(o.detach().clone() for o in slot.outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        slot = ctx.slot
        for static, g in zip(slot.grad_out, grads):
            if static is not None:
                static.copy_(g)
        slot.bwd.replay()
        return (None, None, *[g.detach().clone() if g is not None else None for g in slot.grad_in])


class StateHooks(Protocol):
    """What the caller does about forward state (records a forward leaves for after the step)."""

    def begin_capture(self, chunk: int) -> object: ...
    def end_capture(self, chunk: int, begun: object) -> object: ...
    def replayed(self, chunk: int, kept: object) -> None: ...


class ChunkGraphs:
    """The graphs of one pipeline rank's chunks (module docstring).

    Keyword-only arguments:
    chunks: global chunk index -> module (this rank's chunks, as the engine holds them).
    plan: ``capture_plan`` of this rank's training op list for the step's microbatch count.
    warmup: eager steps before the first graphed one.
    graph_factory: makes a ``Graph`` (``CudaGraph`` on a GPU, ``EagerGraph`` for the CPU path).
    state: forward-state hooks (``StateHooks``), or None when no chunk records anything.
    """

    def __init__(self, *, chunks: dict[int, nn.Module], plan: CapturePlan, warmup: int = 2,
                 graph_factory: Callable[[], Graph] = CudaGraph, state: StateHooks | None = None):
        self.chunks, self.plan, self.warmup = chunks, plan, warmup
        self.graph_factory, self.state = graph_factory, state
        self.params = {c: [p for p in ch.parameters() if p.requires_grad] for c, ch in chunks.items()}
        self.main_grads: dict[nn.Parameter, torch.Tensor] = {}
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.steps = 0
        self.active = False
        self.paused = False
        self._anchor: torch.Tensor | None = None

    @property
    def captured(self) -> int:
        """How many graphs are captured so far (two per slot)."""
        return 2 * len(self.slots)

    # ---- per step -------------------------------------------------------------------------------
    def begin_step(self, num_microbatches: int) -> bool:
        """Start a training step; returns whether its chunks replay graphs (after ``warmup``
        eager steps). The main gradients are zeroed here: the step's replays sum into them."""
        if self.paused:
            self.active = False
            return False
        self.steps += 1
        self.active = self.steps > self.warmup
        if not self.active:
            return False
        if any(len(s) != num_microbatches for s in self.plan.slots.values()):
            raise ValueError(f"the chunk graphs were planned for {len(next(iter(self.plan.slots.values())))} "
                             f"microbatches, this step has {num_microbatches}")
        if not self.main_grads:
            device = next(iter(p for ps in self.params.values() for p in ps)).device
            self._anchor = torch.zeros((), device=device, requires_grad=True)
            self.main_grads = {p: torch.zeros_like(p) for ps in self.params.values() for p in ps}
        else:
            torch._foreach_zero_(list(self.main_grads.values()))
        for ps in self.params.values():
            for p in ps:
                p.grad = None
        return True

    def end_step(self) -> None:
        """Hand the summed gradients to ``.grad`` (parameters no graph reached keep None)."""
        if not self.active:
            return
        reached = {p for s in self.slots.values() for p in s.reached}
        for p, g in self.main_grads.items():
            if p in reached:
                p.grad = g
        self.active = False

    # ---- per chunk call -----------------------------------------------------------------------
    def forward(self, chunk: int, microbatch: int, args: tuple, kwargs: dict | None = None):
        """The graphed ``chunks[chunk](*args, **kwargs)`` of ``microbatch`` (StageIO / tensors in,
        out and as keywords: chunk 0's ``segments``). Document boundaries must come in one fixed
        shape (``k3train.data.documents.document_cu_seqlens_padded``): each replay copies them
        into the slot's static input like any other input."""
        flat, specs = _flatten_args(args, kwargs)
        slot = self.slots.get((chunk, self.plan.slots[chunk][microbatch]))
        if slot is None:
            slot = self._capture(chunk, self.plan.slots[chunk][microbatch], flat, specs)
        elif specs != slot.arg_specs or any(a.shape != s.shape for a, s in zip(flat, slot.static_in)):
            raise ValueError(f"chunk {chunk}: inputs {[tuple(a.shape) for a in flat]} differ from the "
                             f"captured {[tuple(s.shape) for s in slot.static_in]}")
        eager = isinstance(slot.fwd, EagerGraph)
        if eager and self.state is not None:
            # An eager stand-in writes the forward state again at every replay: taken around the
            # replay, as a capture takes it once around the recorded forward.
            begun = self.state.begin_capture(chunk)
        outs = _Replay.apply(slot, self._anchor, *flat)
        if self.state is not None:
            if eager:
                slot.state = self.state.end_capture(chunk, begun)
            self.state.replayed(chunk, slot.state)
        return _unflatten(list(outs), slot.out_spec)

    def _capture(self, chunk: int, index: int, flat: list[torch.Tensor], specs: list[tuple]) -> _Slot:
        slot = _Slot(chunk, index)
        slot.arg_specs = specs
        pool = torch.cuda.graph_pool_handle() if flat[0].is_cuda else None
        slot.static_in = [x.detach().clone().requires_grad_(x.requires_grad) for x in flat]
        module, params = self.chunks[chunk], self.params[chunk]
        begun = self.state.begin_capture(chunk) if self.state is not None else None

        def forward_body():
            args, kwargs = _unflatten_args(slot.static_in, specs)
            slot.outs, slot.out_spec = _flatten(module(*args, **kwargs), segments=False)

        slot.fwd = self.graph_factory()
        slot.fwd.record(forward_body, pool)
        if isinstance(slot.fwd, EagerGraph):
            forward_body()   # the backward body below needs outputs to build its buffers from
        if self.state is not None:
            slot.state = self.state.end_capture(chunk, begun)
        slot.grad_out = [torch.zeros_like(o) if o.requires_grad else None for o in slot.outs]
        ins = [x for x in slot.static_in if x.requires_grad]

        def backward_body():
            roots = [(o, g) for o, g in zip(slot.outs, slot.grad_out) if g is not None]
            grads = torch.autograd.grad([o for o, _ in roots], ins + params, [g for _, g in roots],
                                        allow_unused=True)
            it = iter(grads[:len(ins)])
            slot.grad_in = [next(it) if x.requires_grad else None for x in slot.static_in]
            pairs = [(self.main_grads[p], g) for p, g in zip(params, grads[len(ins):]) if g is not None]
            if not slot.reached:
                slot.reached = [p for p, g in zip(params, grads[len(ins):]) if g is not None]
            if pairs:
                torch._foreach_add_([m for m, _ in pairs], [g for _, g in pairs])

        slot.bwd = self.graph_factory()
        slot.bwd.record(backward_body, pool)
        self.slots[(chunk, index)] = slot
        return slot


@contextmanager
def no_graphs(graphs: ChunkGraphs | None):
    """Eager steps inside a graphed run that count for nothing (compile-ahead's throwaway
    step): the warm-up counter does not move and nothing is captured."""
    if graphs is None:
        yield
        return
    graphs.paused = True
    try:
        yield
    finally:
        graphs.paused = False
