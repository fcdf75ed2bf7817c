"""The ``moe/*`` metrics through the trainer, against the routing the routers actually made.

The reference counts each training forward's expert choices with a plain loop, captured by
wrapping the router's forward, so it shares nothing with the tracker or the dispatchers.
"""
import json
import math

import pytest
import torch

from k3train.trainer.loop import train
from moe import SigmoidTopKRouter
from tests.helpers import small_cfg


def capture_training_routing(monkeypatch) -> dict[int, list[torch.Tensor]]:
    """Wrap ``SigmoidTopKRouter.forward``: returns {router id: [indices [N, k] of each training
    forward]}, in call order (routers are called in layer order, so first calls give the order)."""
    seen: dict[int, list[torch.Tensor]] = {}
    original = SigmoidTopKRouter.forward

    def forward(self, x):
        out = original(self, x)
        if self.training and torch.is_grad_enabled():
            seen.setdefault(id(self), []).append(out.indices.detach().clone())
        return out

    monkeypatch.setattr(SigmoidTopKRouter, "forward", forward)
    return seen


def naive_load(indices_list: list[torch.Tensor], num_experts: int) -> list[int]:
    load = [0] * num_experts
    for indices in indices_list:
        for e in indices.flatten().tolist():
            load[e] += 1
    return load


def naive_max_vio(load: list[int]) -> float:
    mean = sum(load) / len(load)
    return max(load) / mean - 1 if mean > 0 else 0.0


def naive_dropped(indices: torch.Tensor, num_experts: int, capacity_factor: float) -> int:
    """Slots beyond the capacity ceil(c * N * k / E) of each expert (the documented rule)."""
    n, k = indices.shape
    cap = math.ceil(capacity_factor * n * k / num_experts)
    return sum(max(0, c - cap) for c in naive_load([indices], num_experts))


@pytest.mark.slow
def test_metrics_cover_the_logged_step_and_count_dropped_tokens(tmp_path, monkeypatch):
    """log_interval=3: the step-3 record's MaxVio is step 3's alone (it was the sum of steps
    1-3), and moe/dropped_tokens counts the static dispatcher's overflow (it was always 0)."""
    m, cf, experts, steps = 2, 0.5, 4, 3
    seen = capture_training_routing(monkeypatch)
    train(small_cfg(f"train.steps={steps}", "train.log_interval=3", "train.eval_interval=3",
               f"train.microbatches={m}", "moe.dispatcher=grouped_a2a", f"moe.capacity_factor={cf}"),
          tmp_path)
    (rec,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rec["step"] == steps
    layers = list(seen.values())                      # one list per MoE layer, in layer order
    assert len(layers) == 3 and all(len(calls) == steps * m for calls in layers)
    last = [calls[(steps - 1) * m:] for calls in layers]
    # max_vio divides in fp32: agreement to ~1e-7 relative.
    per_layer = [naive_max_vio(naive_load(calls, experts)) for calls in last]
    for i, want in enumerate(per_layer):
        assert rec[f"moe/maxvio/layer{i}"] == pytest.approx(want, rel=1e-6), i
    assert rec["moe/maxvio"] == pytest.approx(sum(per_layer) / 3, rel=1e-6)
    assert rec["moe/maxvio_max"] == pytest.approx(max(per_layer), rel=1e-6)
    running = [naive_max_vio(naive_load(calls, experts)) for calls in layers]
    assert rec["moe/maxvio_running"] == pytest.approx(sum(running) / 3, rel=1e-6)
    dropped = sum(naive_dropped(ix, experts, cf) for calls in last for ix in calls)
    assert dropped > 0, "capacity factor 0.5 must drop slots, or the test proves nothing"
    assert rec["moe/dropped_tokens"] == dropped
