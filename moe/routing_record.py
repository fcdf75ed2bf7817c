"""The one owner of an MoE layer's routing statistics: what its forwards routed and dropped.

``LatentMoE.forward`` writes its ``RoutingRecord`` (``layer.routing``); the balancer, the load
metrics and the CUDA-graph wrapper read it, and the trainer clears it after each step. Nothing
else about routing is stored on the layer.

A step runs several training forwards per layer (one per microbatch); the record keeps of
each one what the step's readers use, until ``clear``, so balancing and the step's load see
every token of the step whatever the microbatch split: the top-k ids (the load metrics and the
aux-free balancer count them), stored as int32, and the scores only when ``keep_scores`` (the
quantile balancer reads them; ``moe.balancing.reads_step_scores``). Nothing else of ``[N, E]``
is kept for the step: the logits and the weights are read by no one after the forward (the
aux-loss balancer's loss is made in the forward itself), and keeping the whole
``RouterOutput`` cost 3,744 bytes per token per MoE layer at K3's widths in bf16 (896 experts,
top 16), against 1,856 with the scores and 64 without. Evaluation forwards (no grad or eval
mode) only update the ``last_*`` fields.

The record is a forward-state holder (``forward_state`` / ``load_forward_state``, the protocol
of k3train/model/forward_state.py): recompute restores it around a recomputed forward, and
the CUDA-graph wrapper re-attaches the tensors a captured forward wrote (at fixed addresses in
the graph's pool, refilled by each replay) after every replay.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .metrics import expert_load
from .router import RouterOutput


@dataclass(eq=False)
class StepRouting:
    """What the step keeps of one training forward's routing (or of several, concatenated).

    indices: ``[N, k]`` selected experts, int32 (the router's int64 ids narrowed: any expert
        count fits, and the counts made from them are the same).
    scores: ``[N, E]`` the router's scores (its dtype), or None when the record does not keep
        them (no configured reader)."""

    indices: torch.Tensor
    scores: torch.Tensor | None

    @staticmethod
    def cat(parts: list["StepRouting"]) -> "StepRouting":
        """Concatenate along N (the scores only when every part kept them)."""
        if len(parts) == 1:
            return parts[0]
        scores = ([p.scores for p in parts] if all(p.scores is not None for p in parts) else None)
        return StepRouting(torch.cat([p.indices for p in parts]),
                           torch.cat(scores) if scores is not None else None)


@dataclass(eq=False)
class RoutingRecord:
    """Routing statistics of one MoE layer (module docstring).

    last: ``RouterOutput`` of the last forward (any mode), detached; None before the first.
    last_tokens_per_expert: ``[E_local]`` int64 rows each local expert got in the last forward.
    last_dropped: 0-dim int64 slots the dispatcher dropped on this rank in the last forward, or
        None for dispatchers that never drop.
    keep_scores: whether ``step`` keeps each forward's ``[N, E]`` scores (True for the quantile
        balancer, the one reader; ``LatentMoE(keep_step_scores=...)`` sets it from the config).
    aux_loss: scalar balance loss of the last forward, or None; in the autograd graph until
        the model's layer takes it (``take_aux_loss``), detached after.
    step: ``StepRouting`` of each training forward since ``clear`` (detached): the ids, and the
        scores when ``keep_scores``.
    step_dropped: 0-dim int64 dropped slots of each training forward since ``clear`` (only for
        dispatchers that drop).
    """

    last: RouterOutput | None = None
    last_tokens_per_expert: torch.Tensor | None = None
    last_dropped: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    step: list[StepRouting] = field(default_factory=list)
    step_dropped: list[torch.Tensor] = field(default_factory=list)
    keep_scores: bool = True

    def add(self, routing: RouterOutput, tokens_per_expert: torch.Tensor,
            dropped: torch.Tensor | None, aux_loss: torch.Tensor | None, training: bool) -> None:
        """Called by the layer once per forward; ``training``: the forward counts for the step."""
        self.last = routing.detach()
        self.last_tokens_per_expert = tokens_per_expert.detach()
        self.last_dropped = dropped
        self.aux_loss = aux_loss
        if training:
            # The ids narrowed to int32 (a copy: the int64 ones are freed with the forward's
            # graph); the scores are the same tensor as ``last``'s, no copy.
            self.step.append(StepRouting(self.last.indices.to(torch.int32),
                                         self.last.scores if self.keep_scores else None))
            if dropped is not None:
                self.step_dropped.append(dropped)

    def take_aux_loss(self) -> torch.Tensor | None:
        """The last forward's balance loss in the autograd graph, for the layer to attach to its
        output; the record keeps only a detached copy. Why: a graph kept past the step holds
        every upstream parameter's gradient accumulator, bound to the stream of the step that
        made it, and a CUDA-graph capture after eager warm-up steps then fails in backward
        (cudaErrorStreamCaptureImplicit, seen with ``balancing: aux_loss`` on an H200)."""
        aux = self.aux_loss
        if aux is not None:
            self.aux_loss = aux.detach()
        return aux

    def clear(self) -> None:
        """Start a new step (the trainer calls it after each step)."""
        self.step = []
        self.step_dropped = []

    def step_routing(self) -> StepRouting | None:
        """Routing of every training forward since ``clear`` concatenated along N (the ids and,
        when kept, the scores), else the last forward's (None before any forward)."""
        if self.step:
            return StepRouting.cat(self.step)
        if self.last is None:
            return None
        return StepRouting(self.last.indices.to(torch.int32), self.last.scores)

    def step_load(self, num_experts: int) -> torch.Tensor:
        """``[E]`` int64 slots routed to each expert by ``step_routing()`` (no host sync)."""
        routing = self.step_routing()
        if routing is None:
            raise RuntimeError("the MoE layer has not run a forward yet: no routing to count")
        return expert_load(routing.indices.long(), num_experts)

    def step_dropped_tokens(self, device: torch.device | None = None) -> torch.Tensor:
        """0-dim int64: slots dropped on this rank by the step's training forwards (no sync)."""
        if not self.step_dropped:
            return torch.zeros((), dtype=torch.int64, device=device)
        return torch.stack(self.step_dropped).sum()

    def forward_state(self) -> dict:
        """The record's fields: the same tensors, new lists (the forward-state protocol of
        k3train/model/forward_state.py, used by recompute and the CUDA-graph wrapper)."""
        return {"last": self.last, "last_tokens_per_expert": self.last_tokens_per_expert,
                "last_dropped": self.last_dropped, "aux_loss": self.aux_loss,
                "step": list(self.step), "step_dropped": list(self.step_dropped)}

    def load_forward_state(self, state: dict) -> None:
        """Re-attach a ``forward_state`` (after a recompute, or a CUDA-graph replay that
        refilled its tensors); the lists are copied again, so a state can be loaded often."""
        self.last, self.last_tokens_per_expert = state["last"], state["last_tokens_per_expert"]
        self.last_dropped, self.aux_loss = state["last_dropped"], state["aux_loss"]
        self.step, self.step_dropped = list(state["step"]), list(state["step_dropped"])
