"""The forward and backward of a training step captured once in a CUDA graph, then replayed.

Why: with fla's Triton kernels the host needs longer to *launch* a K3 step than the GPU needs
to run it (fla's chunk_kda spends milliseconds of Python per call; measured: see
benchmarks/README.md). A replay launches the whole recorded step at once.

How (PyTorch's whole-network capture recipe):
* the first ``warmup`` steps run eagerly, so Triton autotuning, ``torch.compile`` and the
  allocator settle before anything is recorded;
* the next step is captured with every parameter's ``.grad`` unset, so backward allocates the
  gradients from the graph's memory pool; after each replay those same tensors hold the new
  gradients and are handed back to the parameters (the trainer sets ``.grad`` to None after
  every step, which drops only its own references);
* the model's forward state (``k3train/model/forward_state.py``: the MoE routing records, read
  by the balancer and the load metrics after the step, and any other holder) is re-attached the
  same way: a snapshot of the holders taken after the capture holds the tensors the graph
  writes, restored after each replay. Recompute uses the same protocol and the same holders.
Everything a replay reads lives at a fixed address: the token buffer (copied in before each
replay), the weights and router biases (the optimizer and balancer update them in place), and
the activations in the pool. Autocast's weight-cast cache is off during capture, as a cached
cast would be baked into the graph.

Under pipeline parallelism the schedule is driven by the host between chunks, so the step is
not one graph: the engine replays one graph per chunk per in-flight microbatch slot
(``pipeline/chunk_graphs.py``) and ``ChunkForwardState`` below re-adds each replayed chunk's
forward state. Data parallelism reduces the gradients after the replay, eagerly, as without a
graph. Expert parallelism with the static dispatcher (``moe.capacity_factor``) records its
fixed-split all-to-all in the graph; its dropped-slot counts and routing land in the forward
state, read after the replay. Document masking (``data.document_mask``, windows under
``layout_rules.PER_DOCUMENT_MIN_WINDOW``) records fixed-shape boundaries (``CapturedDocuments``;
the chunk graphs copy them in as a static input, ``PaddedDocuments``).
Not supported (``train.cuda_graph: auto`` leaves the graph off
there, ``true`` is refused with an error naming the cause): expert parallelism with the dynamic
dispatcher (split sizes read on the host) and tensor parallelism. The one list of what rules the graph out is ``RunConfig.cuda_graph_blockers``
(asked when the config loads, and again by ``k3train.trainer.state.use_cuda_graph`` with the
device).
``scripts/gpu_check.py`` compares a replay with an eager pass on the same weights.
"""
from __future__ import annotations

from typing import Callable

import torch

from k3train.model.forward_state import (ForwardState, add_state_delta, forward_state_holders, restore,
                                         snapshot, state_delta)


class GraphedForwardBackward:
    """Runs ``fwd_bwd(batch) -> loss`` (a device scalar; gradients land in ``.grad``) eagerly
    for ``warmup`` calls, captures the next call and replays it for every later one.

    Args:
        fwd_bwd: the eager forward+backward of one step; ``batch`` is on the device.
        params: the parameters whose gradients ``fwd_bwd`` produces.
        holders: the forward-state holders ``fwd_bwd`` writes
            (``k3train.model.forward_state.forward_state_holders(model)``); snapshotted after the
            capture and restored after each replay. The capture must start a step: the trainer
            clears the routing records after every step, so the snapshot holds only what the
            captured forwards recorded.
        warmup: eager calls before the capture.
    """

    def __init__(self, fwd_bwd: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter],
                 holders: list[ForwardState], warmup: int = 2,
                 accepts: Callable[[torch.Tensor], bool] | None = None):
        self.fwd_bwd, self.params, self.holders, self.warmup = fwd_bwd, params, holders, warmup
        # accepts(batch): whether the recorded step computes this batch right (a batch with more
        # documents than the fixed-shape boundaries hold runs eagerly: CapturedDocuments).
        self.accepts = accepts
        self.eager_steps = 0   # steps after the warm-up that ran eagerly (accepts said no)
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_batch: torch.Tensor | None = None
        self.static_loss: torch.Tensor | None = None
        self.grads: list[torch.Tensor | None] = []
        self.states: list[dict] = []  # snapshot(holders) after the capture

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """batch: ``[B, T+1]`` token ids (any device) -> the step's mean loss, a device scalar."""
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup:
            return self.fwd_bwd(batch.to(self.params[0].device, non_blocking=True))
        if self.accepts is not None and not self.accepts(batch):
            self.eager_steps += 1
            return self.fwd_bwd(batch.to(self.params[0].device, non_blocking=True))
        if self.graph is None:
            self._capture(batch)
        elif batch.shape != self.static_batch.shape:
            # A batch of another shape (never the case in the trainer) runs eagerly.
            return self.fwd_bwd(batch.to(self.static_batch.device, non_blocking=True))
        self.static_batch.copy_(batch, non_blocking=True)
        self.graph.replay()
        for p, g in zip(self.params, self.grads):
            p.grad = g
        restore(self.holders, self.states)
        return self.static_loss

    def _capture(self, batch: torch.Tensor) -> None:
        device = self.params[0].device
        self.static_batch = batch.to(device).clone()
        for p in self.params:
            p.grad = None
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_loss = self.fwd_bwd(self.static_batch)
        self.graph = graph
        self.grads = [p.grad for p in self.params]
        self.states = snapshot(self.holders)


class CapturedDocuments:
    """A graphed step's document boundaries (``data.document_mask``): the fixed-shape form
    (``WindowDocuments.padded``, computed on the device from the token buffer) while a graph
    records, so every replay recomputes them from the batch copied in; the exact form in eager
    steps (the warm-up, and batches that ``fits`` turns away).

    documents: ``k3train.data.documents.WindowDocuments``; microbatches: how a step's batch is
    cut (``train.microbatches``), each cut having its own boundaries."""

    def __init__(self, documents, microbatches: int):
        self.documents, self.microbatches = documents, microbatches

    def __call__(self, windows: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            return self.documents.padded(windows)
        return self.documents(windows)

    def fits(self, batch: torch.Tensor) -> bool:
        """batch ``[B * microbatches, T+1]``: whether every microbatch's documents fit the fixed
        shape (one host read per microbatch; the batch is on the host before it is copied in)."""
        return all(self.documents.fits(mb) for mb in batch.chunk(self.microbatches))


class PaddedDocuments(CapturedDocuments):
    """Document boundaries under the pipeline's chunk graphs (``pipeline/chunk_graphs.py``):
    the fixed-shape form in every step, computed eagerly on the device (no host read) and
    copied into each replayed chunk's static input, so that the eager warm-up steps run the
    very shapes the graphs record. A step that ``fits`` turns away runs without the graphs,
    with the ``exact`` boundaries (``TrainState._forward_backward``)."""

    def __call__(self, windows: torch.Tensor) -> torch.Tensor:
        return self.documents.padded(windows)

    def exact(self, windows: torch.Tensor) -> torch.Tensor:
        return self.documents(windows)


class ChunkForwardState:
    """The forward-state hooks of the pipeline's chunk graphs (``pipeline.chunk_graphs.StateHooks``).

    A captured chunk forward appends its records (MoE routing, AttnRes depth weights) once, at
    capture, with tensors the graph refills at every replay. The capture's additions are kept
    (``state_delta``) and taken off the holders again; after every replay they are added anew
    as copies (``add_state_delta``), so the holders end the step as after an eager step: one
    record per microbatch, each its own.

    chunks: global chunk index -> module, this rank's chunks.
    """

    def __init__(self, chunks: dict):
        self.holders = {c: forward_state_holders(m) for c, m in chunks.items()}

    def begin_capture(self, chunk: int) -> list[dict]:
        return snapshot(self.holders[chunk])

    def end_capture(self, chunk: int, begun: list[dict]) -> list[dict]:
        added = state_delta(begun, snapshot(self.holders[chunk]))
        restore(self.holders[chunk], begun)
        return added

    def replayed(self, chunk: int, kept: list[dict]) -> None:
        add_state_delta(self.holders[chunk], kept)
