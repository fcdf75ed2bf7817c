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
from .router import SigmoidTopKRouter
from .routing_record import RoutingRecord


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
            ``self.routing.aux_loss`` (in the graph, ready to be added to the loss).
        init_std: std of all weight inits.
        keep_step_scores: whether the routing record keeps each training forward's ``[N, E]``
            scores until the step ends (``RoutingRecord.keep_scores``): needed by the quantile
            balancer only (``moe.balancing.reads_step_scores``).

    ``cp_group``: the context-parallel group (None without CP; set by the model's
    ``use_context_parallel``). Routing is per token and needs nothing from it; the balance
    loss takes its statistics over it (``switch_aux_loss``), so that it is the loss of the
    whole sequences and not of this rank's slice.

    State written by forward: ``self.routing``, the layer's ``RoutingRecord`` (the routing,
    per-expert counts, dropped slots and aux loss of its forwards; read by the balancer, the
    load metrics and the CUDA-graph wrapper, cleared by the trainer after each step).
    """

    def __init__(self, *, hidden_size: int, latent_size: int, num_experts: int, topk: int,
                 expert_ffn_size: int, num_shared_experts: int = 0, shared_ffn_size: int = 0,
                 dispatcher: TokenDispatcher | None = None, aux_loss_coef: float = 0.0,
                 init_std: float = 0.02, keep_step_scores: bool = True):
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
        self.routing = RoutingRecord(keep_scores=keep_step_scores)
        self.cp_group = None

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
        aux_loss = (self.aux_loss_coef * switch_aux_loss(
            routing.scores, routing.indices, self.num_experts, self.topk, self.cp_group)
            if self.aux_loss_coef > 0 else None)
        self.routing.add(routing, tokens_per_expert, state.dropped, aux_loss,
                         training=self.training and torch.is_grad_enabled())
        return out.reshape(shape)
