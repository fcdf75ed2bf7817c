"""Expert load balancing: Quantile Balancing and the aux-loss-free / aux-loss baselines.

Quantile Balancing (hyperparameter-free) sets each expert's selection bias directly from the
current batch instead of nudging it. With scores ``s [N, E]``, bias ``b [E]`` and top-k:

* per token i the cutoff ``c_i`` is the (k+1)-th largest biased score ``s_i + b``: a token
  would take expert j in place of its current k-th choice once ``s_ij + b'_j > c_i``;
* expert j's margins are ``m_ij = s_ij - c_i``; with the target ``q = floor(N k / E)`` its
  threshold ``t_j`` is the (q+1)-th largest margin, so q margins lie strictly above it
  when there are no ties at ``t_j`` and ``b'_j = -t_j`` gives expert j exactly q tokens
  with ``s_ij + b'_j > c_i``;
* the new bias is ``b'`` mean-centred (a common shift does not change any top-k).

Ties: even with continuous scores every token's (k+1)-th expert j has margin ``-b_j``
(exactly for b_j = 0, up to rounding otherwise: its biased score *is* the cutoff). When expert j's (q+1)-th margin falls in that
block, j keeps its bias and gets fewer than q votes; the shortfall is at most the block size.

``q`` uses floor so that no expert's target exceeds its fair share; the remaining
``N k - E q < E`` slots are placed by the top-k itself. ``q + 1 <= N`` always holds because
``k < E`` is required (the (k+1)-th score must exist), so ``q <= N (E-1)/E < N``. The
cutoffs themselves move once every bias changes, so re-routing lands near, not exactly on,
q tokens per expert; see tests/moe/test_balancing.py for the exact slack.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .metrics import expert_load
from .topk import row_topk

BALANCER_NAMES = ("quantile", "aux_free", "aux_loss", "none")


def reads_step_scores(name: str) -> bool:
    """Whether balancer ``name`` reads the step's ``[N, E]`` scores (only Quantile Balancing);
    the MoE layers' routing records keep them for the step only then (moe/routing_record.py).
    The others read the ids ("aux_free") or nothing ("aux_loss": its loss is made in the
    forward; "none")."""
    if name not in BALANCER_NAMES:
        raise ValueError(f"unknown balancer {name!r}; allowed: {', '.join(BALANCER_NAMES)}")
    return name == "quantile"


def _margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """scores ``[N, E]``, bias ``[E]`` -> margins ``s_ij - c_i`` ``[N, E]``."""
    num_experts = scores.shape[-1]
    if not 0 < k < num_experts:
        raise ValueError(f"quantile balancing needs 0 < k < num_experts={num_experts}, got {k}")
    dtype = torch.promote_types(scores.dtype, bias.dtype)
    s = scores.to(dtype)
    cutoff = row_topk(s, k + 1, bias.to(dtype))[0][:, -1:]
    return s - cutoff


def _thresholds(values: torch.Tensor, q: int) -> torch.Tensor:
    """values ``[M, E]`` -> ``[E]``: the (q+1)-th largest of each column.

    (q+1)-th largest of M values == (M-q)-th smallest; kthvalue avoids materialising q rows.
    Over a contiguous last dim after a transpose, which is faster on GPU than along dim 0 with
    the same result (measured: see benchmarks/README.md)."""
    return torch.kthvalue(values.t().contiguous(), values.shape[0] - q, dim=1).values


def _bias_from_thresholds(thresholds: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    new_bias = -thresholds
    return (new_bias - new_bias.mean()).to(bias.dtype)


@torch.no_grad()
def quantile_balance(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """scores: ``[N, E]`` sigmoid scores (fp32); bias: ``[E]`` current bias -> new bias ``[E]``.

    Exact single-process Quantile Balancing (module docstring). An empty batch returns the
    bias unchanged.
    """
    n = scores.shape[0]
    if n == 0:
        return bias.clone()
    margins = _margins(scores, bias, k)
    q = n * k // scores.shape[-1]
    return _bias_from_thresholds(_thresholds(margins, q), bias)


@torch.no_grad()
def quantile_balance_distributed(scores: torch.Tensor, bias: torch.Tensor, k: int,
                                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Quantile Balancing over the tokens of every rank in ``group`` (default: world).

    scores: this rank's ``[N_r, E]``; bias: ``[E]``, identical on all ranks. Returns ``[E]``,
    bitwise equal to ``quantile_balance`` on the concatenated scores, on every rank.

    Each rank keeps only its ``R = min(q+1, max_r N_r)`` largest margins per expert: the
    global (q+1)-th largest margin of expert j is among the union of the local top-(q+1)
    lists. Ranks with fewer than R tokens pad with -inf, which never reaches rank q+1 because
    the real entries number ``sum_r min(q+1, N_r) >= q+1``. Communication: one all-gather of
    the token counts (world ints) and one of ``world * R * E`` values, i.e.
    ``min(world (q+1), world max_r N_r) * E``: about ``world * k * N_global`` when
    ``world * k < E`` and never more than gathering all scores (for equal N_r). The result is
    computed redundantly on every rank from identical data, so all ranks agree without a
    broadcast.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return quantile_balance(scores, bias, k)
    world = dist.get_world_size(group)
    num_experts = scores.shape[-1]
    counts = [torch.zeros(1, dtype=torch.int64, device=scores.device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([scores.shape[0]], device=scores.device), group=group)
    counts_list = [int(c.item()) for c in counts]
    n_total, n_max = sum(counts_list), max(counts_list)
    if n_total == 0:
        return bias.clone()
    margins = _margins(scores, bias, k)
    q = n_total * k // num_experts
    rows = min(q + 1, n_max)
    local = torch.topk(margins, min(q + 1, margins.shape[0]), dim=0).values
    padded = margins.new_full((rows, num_experts), float("-inf"))
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    candidates = torch.cat(gathered, dim=0)
    return _bias_from_thresholds(_thresholds(candidates, q), bias)


@torch.no_grad()
def aux_free_update(bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                    rate: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free update ``b_e += rate * sign(mean load - load_e)``.

    bias: ``[E]``; tokens_per_expert: ``[E]`` counts -> new bias ``[E]``.
    """
    load = tokens_per_expert.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)


def switch_aux_loss(scores: torch.Tensor, indices: torch.Tensor, num_experts: int,
                    topk: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Switch-style balance loss ``E * sum_e f_e P_e``; 1.0 when perfectly balanced.

    scores: ``[N, E]`` sigmoid scores (in the graph); indices: ``[N, k]``.
    ``f_e`` = fraction of the N*k routed slots going to e (no gradient);
    ``P_e`` = mean over tokens of the per-token normalised scores (carries the gradient).

    group: the ranks holding the other parts of the same sequences (context parallelism), or
    None. Then ``f`` and ``P`` are over the tokens of all its ``W`` ranks and each rank returns
    its share ``W * E * sum_e f_e S_e / N`` (``S_e`` its own tokens' summed normalised scores,
    ``N`` all ranks' tokens): the shares average to the loss of the whole sequences, and so do
    their gradients, whose mean over the ranks the trainer takes. Only the counts cross ranks
    (one all-reduce of ``E + 1`` values, no autograd).
    """
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        return _switch_aux_loss_share(scores, indices, num_experts, topk, group)
    n = scores.shape[0]
    if n == 0:
        return scores.sum() * 0.0
    f = expert_load(indices, num_experts).to(scores.dtype) / (n * topk)
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
    return num_experts * (f * p).sum()


def _switch_aux_loss_share(scores: torch.Tensor, indices: torch.Tensor, num_experts: int,
                           topk: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's share of ``switch_aux_loss`` over ``group`` (its docstring)."""
    world = dist.get_world_size(group)
    counts = torch.cat([expert_load(indices, num_experts),
                        torch.tensor([scores.shape[0]], dtype=torch.int64, device=indices.device)])
    dist.all_reduce(counts, group=group)
    # No host read: with no token anywhere ``s`` is all zeros and the share is 0 (n clamped).
    n = counts[-1].clamp(min=1).to(scores.dtype)
    f = counts[:-1].to(scores.dtype) / (n * topk)
    s = (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=0)
    return world * num_experts * (f * s).sum() / n


class Balancer:
    """Updates an MoE layer's router bias after each optimizer step.

    name: one of ``BALANCER_NAMES``; "aux_loss" and "none" leave the bias alone (the aux loss
    is produced by the layer itself via ``aux_loss_coef``). rate: step of "aux_free".
    """

    def __init__(self, name: str, rate: float = 1e-3):
        if name not in BALANCER_NAMES:
            raise ValueError(f"unknown balancer {name!r}; allowed: {', '.join(BALANCER_NAMES)}")
        self.name, self.rate = name, rate

    @property
    def updates_bias(self) -> bool:
        return self.name in ("quantile", "aux_free")

    @torch.no_grad()
    def update(self, moe_layer, group: dist.ProcessGroup | None = None) -> None:
        """Read the layer's routing of this step (all microbatches, ``moe_layer.routing``, a
        ``RoutingRecord``) and overwrite ``moe_layer.router.bias`` in place.

        group: ranks that saw different tokens of this layer (DP x CP: the data-parallel
        replicas and the context-parallel ranks holding the other parts of their sequences;
        EP lies inside it); when given, the statistics are combined over it so every rank
        writes the same bias. None = local only.
        """
        if not self.updates_bias:
            return
        routing = moe_layer.routing.step_routing()
        if routing is None:
            raise RuntimeError("Balancer.update called before the MoE layer ran a forward")
        router = moe_layer.router
        distributed = group is not None and dist.is_initialized()
        if self.name == "quantile":
            if routing.scores is None:
                raise RuntimeError("quantile balancing reads the step's scores, but the MoE layer's "
                                   "routing record kept none: build it with keep_step_scores=True")
            if distributed:
                new_bias = quantile_balance_distributed(routing.scores, router.bias,
                                                        router.topk, group)
            else:
                new_bias = quantile_balance(routing.scores, router.bias, router.topk)
        else:
            load = expert_load(routing.indices.long(), router.num_experts)
            if distributed:
                dist.all_reduce(load, group=group)
            new_bias = aux_free_update(router.bias, load, self.rate)
        router.bias.copy_(new_bias)

    def __repr__(self) -> str:
        return f"Balancer(name={self.name!r}, rate={self.rate})"
