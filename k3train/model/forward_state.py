"""Forward state: what a forward pass leaves behind for others to read, and the one way to
snapshot and restore it.

A module's forward may record something that is read after it: the MoE routing of each
forward (read by the balancer and the load statistics), the AttnRes depth weights while they
are recorded. Such state lives in a *holder*, an object with the two methods of
``ForwardState``, kept as an attribute of a module (or a module itself). Holders today:

* ``moe.RoutingRecord`` (``LatentMoE.routing``): routing, per-expert counts, dropped slots and
  balance loss of the layer's forwards;
* ``k3train.model.attnres.DepthWeights``: the AttnRes depth weights, on every ``DepthAttention``
  while ``record_depth_weights`` is active.

Two users, both through ``forward_state_holders``, ``snapshot`` and ``restore``:

* activation recompute (``k3train/model/recompute.py``): a recomputed forward writes the state
  again; the region snapshots the holders before it and restores them after, so readers see
  each forward once;
* CUDA graphs (``k3train/trainer/cuda_graph.py``): the state a captured forward wrote holds
  tensors at the graph's addresses; a snapshot taken after the capture is restored after every
  replay.

Adding a holder is one change: give its class ``forward_state`` and ``load_forward_state`` and
keep it on a module; both users find it. Nothing else a forward writes may outlive the forward
(``tests/model/test_recompute_forward_state.py`` checks the whole model).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch.nn as nn


@runtime_checkable
class ForwardState(Protocol):
    """An object holding what forwards recorded (module docstring)."""

    def forward_state(self) -> dict:
        """A shallow copy of the recorded state: the same tensors, new containers, so that
        later forwards do not change it."""

    def load_forward_state(self, state: dict) -> None:
        """Put back what ``forward_state`` returned (again in new containers, so one snapshot
        can be loaded many times)."""


def is_forward_state(obj) -> bool:
    """Whether ``obj`` implements ``ForwardState`` (checked on its class: cheaper than the
    protocol's isinstance, which recompute would pay for every object of every layer)."""
    cls = type(obj)
    return (not isinstance(obj, type) and callable(getattr(cls, "forward_state", None))
            and callable(getattr(cls, "load_forward_state", None)))


def forward_state_holders(root: nn.Module) -> list[ForwardState]:
    """Every holder in ``root``: its modules that implement the protocol and the attributes of
    its modules that do, each once, in module order."""
    seen: set[int] = set()
    found: list[ForwardState] = []
    for module in root.modules():
        for obj in (module, *vars(module).values()):
            if id(obj) not in seen and is_forward_state(obj):
                seen.add(id(obj))
                found.append(obj)
    return found


def snapshot(holders: list[ForwardState]) -> list[dict]:
    """The state of each holder, in order (see ``ForwardState.forward_state``)."""
    return [h.forward_state() for h in holders]


def restore(holders: list[ForwardState], states: list[dict]) -> None:
    """Load ``snapshot(holders)`` back into the same holders."""
    if len(holders) != len(states):
        raise ValueError(f"{len(states)} saved states for {len(holders)} forward-state holders")
    for h, s in zip(holders, states):
        h.load_forward_state(s)
