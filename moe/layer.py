"""Stable LatentMoE: routed SiTU-GLU experts in a narrow latent space plus a shared expert.

    router(x) -> top-k experts and weights            (on the full hidden x)
    latent = down(x)                                   d -> latent
    routed = sum_k w_k E_k(latent)                     experts in the latent dim
    out    = up(RMSNorm(routed)) + shared(x)           latent -> d, shared on full width

Running the experts in the latent dim cuts expert weights and all-to-all traffic by
hidden/latent; the RMSNorm before ``up`` keeps the scale of the routed sum stable whatever
the routing weights (the "Stable" in Stable LatentMoE).
"""
from __future__ import annotations

import torch
from torch import nn

from .balancing import switch_aux_loss
from .dispatch import LocalDispatcher, TokenDispatcher
from .experts import GroupedExperts, SiTUGLUMLP
from .norm import RMSNorm
from .router import RouterOutput, SigmoidTopKRouter


class LatentMoE(nn.Module):
    """Stable LatentMoE layer (module docstring); ``[B, T, d]`` or ``[N, d]`` -> same shape.

    Args:
        hidden_size: model width d.
        latent_size: width the routed experts run in (down/up projections exist even when it
            equals hidden_size, as in K3).
        num_experts, topk: routed experts and experts per token.
        expert_ffn_size: intermediate size of each routed expert.
        num_shared_experts, shared_ffn_size: the shared branch is ONE SiTU-GLU MLP of width
            ``num_shared_experts * shared_ffn_size``; none when num_shared_experts == 0.
        dispatcher: token dispatcher (default ``LocalDispatcher``); the routed experts are
            built for its ``num_local_experts``.
        aux_loss_coef: when > 0, forward stores ``aux_loss_coef * switch_aux_loss`` in
            ``self.aux_loss`` (in the graph, ready to be added to the loss).
        init_std: std of all weight inits.

    State written by forward (read by balancers and metrics, outside autograd):
        last_routing: ``RouterOutput`` of the last forward, detached; training forwards are also
            collected until ``clear_step_routing`` (read with ``step_routing``).
        tokens_per_expert: ``[E_local]`` counts of the last forward (local experts).
        aux_loss: scalar tensor or None.
        dropped_tokens: the dispatcher's ``dropped_tokens`` after the last forward (0-dim
            tensor of slots dropped on this rank), or None for dispatchers that never drop.
    """

    def __init__(self, hidden_size: int, latent_size: int, num_experts: int, topk: int,
                 expert_ffn_size: int, num_shared_experts: int = 0, shared_ffn_size: int = 0,
                 dispatcher: TokenDispatcher | None = None, aux_loss_coef: float = 0.0,
                 init_std: float = 0.02):
        super().__init__()
        self.hidden_size, self.latent_size = hidden_size, latent_size
        self.num_experts, self.topk = num_experts, topk
        self.aux_loss_coef = aux_loss_coef
        self.dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(num_experts)
        if self.dispatcher.num_experts != num_experts:
            raise ValueError(f"dispatcher routes {self.dispatcher.num_experts} experts, "
                             f"layer has {num_experts}")
        self.router = SigmoidTopKRouter(hidden_size, num_experts, topk, init_std=init_std)
        self.down = nn.Linear(hidden_size, latent_size, bias=False)
        local = self.dispatcher.num_local_experts
        self.experts = GroupedExperts(local, latent_size, expert_ffn_size, init_std=init_std,
                                      expert_offset=getattr(self.dispatcher, "ep_rank", 0) * local,
                                      total_experts=num_experts)
        self.norm = RMSNorm(latent_size, eps=1e-6)
        self.up = nn.Linear(latent_size, hidden_size, bias=False)
        self.shared = (SiTUGLUMLP(hidden_size, num_shared_experts * shared_ffn_size,
                                  init_std=init_std)
                       if num_shared_experts > 0 else None)
        nn.init.normal_(self.down.weight, std=init_std)
        nn.init.normal_(self.up.weight, std=init_std)
        self.last_routing: RouterOutput | None = None
        self._step_routing: list[RouterOutput] = []
        self.tokens_per_expert: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self.dropped_tokens: torch.Tensor | None = None

    def step_routing(self) -> RouterOutput | None:
        """Routing of every training forward since ``clear_step_routing`` (all microbatches of
        the step, so balancing sees the same tokens whatever the microbatch split), else the
        last forward's."""
        return RouterOutput.cat(self._step_routing) if self._step_routing else self.last_routing

    def clear_step_routing(self) -> None:
        self._step_routing = []

    def step_routing_list(self) -> list[RouterOutput]:
        """The routing recorded by each training forward since ``clear_step_routing``."""
        return list(self._step_routing)

    def set_step_routing_list(self, routing: list[RouterOutput]) -> None:
        """Re-attach routing recorded elsewhere (a replayed CUDA graph writes its tensors)."""
        self._step_routing = list(routing)
        if routing:
            self.last_routing = routing[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[B, T, d]`` or ``[N, d]`` -> same shape and dtype."""
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        routing = self.router(x2)
        latent = self.down(x2)
        x_sorted, tokens_per_expert, state = self.dispatcher.dispatch(
            latent, routing.indices, routing.weights)
        y_sorted = self.experts(x_sorted, tokens_per_expert)
        routed = self.dispatcher.combine(y_sorted, state)
        out = self.up(self.norm(routed))
        if self.shared is not None:
            out = out + self.shared(x2)
        self.last_routing = routing.detach()
        if self.training and torch.is_grad_enabled():
            self._step_routing.append(self.last_routing)
        self.tokens_per_expert = tokens_per_expert.detach()
        self.dropped_tokens = getattr(self.dispatcher, "dropped_tokens", None)
        self.aux_loss = (self.aux_loss_coef * switch_aux_loss(
            routing.scores, routing.indices, self.num_experts, self.topk)
            if self.aux_loss_coef > 0 else None)
        return out.reshape(shape)
