"""fp32 gradient accumulation for low-precision (bf16) weights: one ``main_grad`` per parameter.

With bf16 weights autograd leaves bf16 gradients in ``p.grad``; summing the microbatches of a
step there would round every partial sum to bf16 (8 mantissa bits). Instead, after each
backward has accumulated into ``p.grad``, a post-accumulate hook adds it into an fp32 buffer
``p.main_grad`` (shape of ``p``) and drops ``p.grad``, so the sum over microbatches is an fp32
sum of the per-microbatch gradients, each exactly converted from bf16 (megatron-core's
``main_grad``). The first backward of a step copies instead of adding (no zeroing pass).

Per parameter:
    ``p.main_grad``: None until a backward reached ``p`` this step, then the fp32 buffer
    ``[*p.shape]`` holding the sum of this step's gradients. The buffer itself persists across
    steps (``MainGrads.buffers``: 4 bytes per element for the whole run, as megatron-core's
    grad buffer); ``clear()`` only unlinks it.
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["MainGrads"]


class MainGrads:
    """Attach fp32 ``main_grad`` accumulation to ``params`` (any dtype; an fp32 parameter's
    gradient is accumulated in fp32 too, in a separate buffer).

    Keywords: ``params`` (the trainable parameters). ``clear()`` between steps; ``remove()``
    takes the hooks off again.
    """

    def __init__(self, *, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.buffers: dict[int, torch.Tensor] = {}
        self._handles = []
        for p in self.params:
            p.main_grad = None
            self._handles.append(p.register_post_accumulate_grad_hook(self._accumulate))

    @torch.no_grad()
    def _accumulate(self, p: torch.nn.Parameter) -> None:
        buf = self.buffers.get(id(p))
        if buf is None:
            buf = self.buffers[id(p)] = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        if p.main_grad is None:
            p.main_grad = buf.copy_(p.grad)   # bf16 -> fp32 is exact
        else:
            p.main_grad.add_(p.grad)          # fp32 sum of the microbatch gradients
        p.grad = None  # the bf16 gradient lives only until its hook: no second copy per step

    def clear(self) -> None:
        """Forget this step's gradients (``p.main_grad = None``; the buffers stay allocated)."""
        for p in self.params:
            p.main_grad = None
            p.grad = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
