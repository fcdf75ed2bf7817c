"""The decode step replayed from a CUDA graph: captured once per key (the batch size and the
sampling settings) after eager warm-up steps, then replayed.

Why: a K3 decode step is hundreds of small kernels (per layer: projections, the short convs,
fla's recurrence, the latent attention, the router and experts) over a handful of tokens; the
GPU finishes each faster than the host launches the next, so eager decoding runs at the host's
launch rate (11-13 tokens/s on ``k3_mini`` on an H200). A replay launches the whole step at once.

The step given to ``GraphedDecoder.run`` must be capturable: it reads and writes only
preallocated static tensors (``k3train.infer.decoder.DecodeBuffers``), in place, with fixed
shapes and no host synchronisation. The same step runs eagerly where graphs are off (CPU, or
``--cuda-graph false``): one code path, replayed or not.

How (PyTorch's capture recipe): ``warmup`` eager calls per key on a side stream (Triton
autotuning, cuBLAS workspaces and the allocator settle there, not inside the capture), then
one capture (which records and does not run the kernels), then a replay for that call and every
later one. Warm-up calls and replays are real decode steps: each advances the buffers once.
"""
from __future__ import annotations

from typing import Callable, Hashable, Protocol

import torch


class Graph(Protocol):
    def replay(self) -> None: ...


class CudaGraphs:
    """The CUDA side of ``GraphedDecoder``: eager warm-up on a side stream, capture, replay."""

    def warm(self, step: Callable[[], None]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, step: Callable[[], None]) -> Graph:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph


class GraphedDecoder:
    """Runs a static-buffer decode step eagerly or from a graph captured per key.

    Args:
        enabled: capture and replay (CUDA); False runs every call eagerly.
        warmup: eager calls per key before its capture.
        graphs: the capture backend (``CudaGraphs``; tests pass a fake with ``warm`` and
            ``capture``).

    ``run(key, step)``: ``step`` is the step for ``key``'s buffers (the same buffers for every
    call with that key, e.g. the batch size); a new key warms up and captures its own graph, an
    earlier key's graph stays. ``forget()`` drops every graph (the buffers were reallocated).
    """

    def __init__(self, *, enabled: bool, warmup: int = 2, graphs: CudaGraphs | None = None):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (autotuning must not run inside a capture), got {warmup}")
        self.enabled, self.warmup = enabled, warmup
        self.backend = graphs if graphs is not None else CudaGraphs()
        self.graphs: dict[Hashable, Graph] = {}
        self.warmed: dict[Hashable, int] = {}
        self.captures = 0  # graphs captured so far (reported by the benchmark)

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        """One decode step for ``key``: eager, a warm-up, a capture then replay, or a replay."""
        if not self.enabled:
            step()
            return
        graph = self.graphs.get(key)
        if graph is None:
            done = self.warmed.get(key, 0)
            if done < self.warmup:
                self.warmed[key] = done + 1
                self.backend.warm(step)
                return
            graph = self.graphs[key] = self.backend.capture(step)
            self.captures += 1
        graph.replay()

    def forget(self) -> None:
        self.graphs.clear()
        self.warmed.clear()
