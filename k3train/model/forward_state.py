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
  tensors at the graph's addresses; for the whole-step graph a snapshot taken after the capture
  is restored after every replay; the pipeline's chunk graphs replay one chunk's forward per
  microbatch, so what the captured forward added (``state_delta``) is added again, copied,
  after every replay (``add_state_delta``).

Adding a holder is one change: give its class ``forward_state`` and ``load_forward_state`` and
keep it on a module; both users find it. Nothing else a forward writes may outlive the forward
(``tests/model/test_recompute_forward_state.py`` checks the whole model).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch
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


def _clone(obj):
    """``obj`` with every tensor inside it (dataclass fields, dicts, lists, tuples) cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _clone(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def state_delta(before: list[dict], after: list[dict]) -> list[dict]:
    """What forwards added between two snapshots of the same holders: per holder, each list
    entry's new tail and each other entry that now holds another object. The rule the
    pipeline's chunk graphs replay by (``add_state_delta``): lists grow, other fields are
    replaced."""
    out = []
    for b, a in zip(before, after):
        delta = {}
        for key, value in a.items():
            if isinstance(value, list):
                if len(value) > len(b[key]):
                    delta[key] = value[len(b[key]):]
            elif value is not b[key]:
                delta[key] = value
        out.append(delta)
    return out


def add_state_delta(holders: list[ForwardState], deltas: list[dict]) -> None:
    """Apply ``state_delta``'s result to the holders as if the forwards ran again, with copies
    of its tensors: a CUDA graph refills the captured tensors at every replay, so what a reader
    keeps past the next replay must be its own copy."""
    if len(holders) != len(deltas):
        raise ValueError(f"{len(deltas)} state deltas for {len(holders)} forward-state holders")
    for h, delta in zip(holders, deltas):
        if not delta:
            continue
        state = h.forward_state()
        for key, value in delta.items():
            state[key] = state[key] + _clone(value) if isinstance(value, list) else _clone(value)
        h.load_forward_state(state)
