"""One autocast region per training step (``TrainState._forward_backward``): every weight is cast
to bf16 once per step, not once per microbatch, and nothing else changes.

Reference: the per-microbatch loop the trainer ran before (a new autocast context around each
microbatch's forward, backward outside it), written out here, on an identically seeded state.
CPU bf16 autocast stands in for CUDA's (on a toy model: the K3 layers run autocast on CUDA only);
the same weights cast to the same dtype give the same values, so losses and gradients must be
bitwise equal."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3train.trainer.state import TrainState

M = 3  # microbatches


class _WeightCasts(TorchDispatchMode):
    """Counts ``_to_copy`` calls whose input is one of ``params`` (a weight cast)."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Toy(torch.nn.Module):
    """Embedding, two linears (autocast casts their weights), cross-entropy: ``(x, y) -> loss``."""

    def __init__(self):
        super().__init__()
        self.embed, self.up, self.down = torch.nn.Embedding(257, 16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 257)

    def forward(self, x, y):
        logits = self.down(torch.nn.functional.gelu(self.up(self.embed(x))))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _state():
    """What ``TrainState._forward_backward`` reads of its state (pp=1), with CPU bf16 autocast."""
    torch.manual_seed(0)
    model = _Toy()
    return SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(microbatches=M)), device=torch.device("cpu"),
                           engine=None, model=model, params=list(model.parameters()), targets=lambda w: w[:, 1:],
                           documents=lambda w: None, autocast=torch.autocast("cpu", dtype=torch.bfloat16),
                           cp=1)


def _per_microbatch(state, batch):
    total = torch.zeros(())
    for mb in batch.chunk(M):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = state.model(mb[:, :-1], state.targets(mb))
        (loss / M).backward()
        total += loss.detach() / M
    return total


def test_one_cast_per_weight_per_step_and_the_same_gradients():
    batch = torch.randint(0, 257, (2 * M, 17), generator=torch.Generator().manual_seed(3))
    ref, new = _state(), _state()
    with _WeightCasts(ref.params) as ref_casts:
        ref_loss = _per_microbatch(ref, batch)
    with _WeightCasts(new.params) as new_casts:
        loss = TrainState._forward_backward(new, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for (name, p), q in zip(new.model.named_parameters(), ref.params, strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda s: f"{name}: {s}")
    assert ref_casts.count > 0 and ref_casts.count % M == 0
    assert new_casts.count == ref_casts.count // M
