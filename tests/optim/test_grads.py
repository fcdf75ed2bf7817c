"""The one gradient path (``optim.grads``): the replicated optimizer (``DataParallelGrads`` +
``build_optimizer``) and the ZeRO-1 ``ShardedOptimizer`` compute the same global grad norm and
the same clipped AdamW update as a naive single-process reference: the reduced gradient written
out by hand, ``torch.nn.utils.clip_grad_norm_`` and one ``torch.optim.AdamW`` group per
parameter.

Tolerance: norms and parameters within ``atol=rtol=1e-5`` (fp32; the collectives sum in their
own order). Without distributed ranks the two paths must agree with the reference to 1e-6.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optim import (DataParallelGrads, GradGroups, ParamRule, ShardedOptimizer, build_optimizer,
                   build_param_table)
from tests.multiproc import run_multiprocess

TOL = dict(atol=1e-5, rtol=1e-5)
LR, WD = 0.01, 0.1
RULES = [ParamRule(r"bias$", "adamw", wd_mult=0.0), ParamRule(r"^head\.", "adamw", lr_mult=0.5),
         ParamRule(r".", "adamw")]
DENSE = {"embed.weight": (11, 8), "mlp.up.weight": (24, 8), "mlp.up.bias": (24,), "head.weight": (11, 8)}
EXPERTS = {"experts.w_in": (2, 8, 6), "experts.w_out": (2, 6, 8)}


def make_table(shapes: dict, seed: int):
    gen = torch.Generator().manual_seed(seed)
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in shapes.items()]
    return build_param_table(named, RULES)


def rank_grads(table, rank: int, step: int) -> list[torch.Tensor]:
    """What backward leaves in ``p.grad`` on ``rank`` at ``step`` (different on every rank)."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + len(table))
    return [3 * torch.randn(e.shape, generator=gen) for e in table]


class NaiveReference:
    """The whole model in one process: hand-reduced gradients, clip_grad_norm_, plain AdamW."""

    def __init__(self, tables: list[list]):
        self.entries = [e for t in tables for e in t]
        self.opt = torch.optim.AdamW(
            [{"params": [e.param], "lr": LR * e.lr_mult, "weight_decay": WD * e.wd_mult}
             for e in self.entries], lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)

    def step(self, grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        for e, g in zip(self.entries, grads):
            e.param.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_([e.param for e in self.entries], max_norm)
        self.opt.step()
        return norm


def _set(table, grads) -> None:
    for e, g in zip(table, grads):
        e.param.grad = g.clone()


def _replicated_step(table, opt, grads: DataParallelGrads, max_norm: float) -> torch.Tensor:
    """The trainer's replicated step: reduce, norm, clip (when it bites), update."""
    grads.reduce_grads()
    norm = grads.global_grad_norm()
    grads.clip_grads_(norm, max_norm)
    opt.step()
    opt.zero_grad()
    return norm


def _assert_close(table, ref_table, **tol) -> None:
    for e, r in zip(table, ref_table):
        torch.testing.assert_close(e.param.detach(), r.param.detach(), msg=e.name, **tol)


@pytest.mark.parametrize("max_norm", [1.0, 1e9], ids=["clipped", "unclipped"])
def test_one_rank_paths_match_naive_clip_and_adamw(max_norm):
    tables = {k: make_table(DENSE, 0) for k in ("replicated", "sharded", "ref")}
    replicated = build_optimizer(tables["replicated"], "adamw", lr=LR, weight_decay=WD)
    rep_grads = DataParallelGrads([e.param for e in tables["replicated"]], groups=GradGroups())
    sharded = ShardedOptimizer(tables["sharded"], name="adamw", lr=LR, weight_decay=WD)
    ref = NaiveReference([tables["ref"]])
    for step in range(3):
        g = rank_grads(tables["ref"], 0, step)
        want = ref.step(g, max_norm)
        assert (want > max_norm) == (max_norm == 1.0)  # the clip bites exactly in "clipped"
        _set(tables["replicated"], g)
        _set(tables["sharded"], g)
        got_rep = _replicated_step(tables["replicated"], replicated, rep_grads, max_norm)
        got_sharded = sharded.step(max_grad_norm=max_norm)
        sharded.zero_grad()
        for got in (got_rep, got_sharded):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        for name in ("replicated", "sharded"):
            _assert_close(tables[name], tables["ref"], atol=1e-6, rtol=1e-6)


# ---- DP=4 with EP=2: dense over DP, experts summed over their expert-DP copies ---------------
def _dp4_ep2_body(rank: int, world: int) -> None:
    # EP groups {0,1},{2,3} (rank r holds expert shard r % 2); expert-DP groups {0,2},{1,3}.
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shard = rank % 2
    groups = GradGroups(dp=dist.group.WORLD, expert_dp=edp_groups[shard], ep=ep_groups[rank // 2])
    with pytest.raises(ValueError, match="expert_dp has 2 ranks, which does not divide dp's 1"):
        GradGroups(expert_dp=edp_groups[shard])  # no DP group: the divisor would be wrong
    max_norm = 2.0
    # The naive reference: dense grads averaged over the 4 ranks; expert shard s summed over its
    # copies (ranks s and s + 2) and divided by dp=4, the module docstring's convention.
    ref_tables = [make_table(DENSE, 0), make_table(EXPERTS, 10), make_table(EXPERTS, 11)]
    ref = NaiveReference(ref_tables)

    def mine():
        return make_table(DENSE, 0) + make_table(EXPERTS, 10 + shard)

    rep_table, sh_table = mine(), mine()
    n_dense = len(DENSE)
    rep_opt = build_optimizer(rep_table, "adamw", lr=LR, weight_decay=WD)
    rep_grads = DataParallelGrads([e.param for e in rep_table], groups=groups,
                                  expert_params=[e.param for e in rep_table[n_dense:]])
    sharded = ShardedOptimizer(sh_table, name="adamw", lr=LR, weight_decay=WD, groups=groups,
                               is_expert=lambda n: n.startswith("experts."))
    for step in range(3):
        per_rank = [rank_grads(rep_table, r, step) for r in range(world)]
        dense = [sum(gs) / world for gs in zip(*(g[:n_dense] for g in per_rank))]
        experts = [[sum(gs) / world for gs in zip(*(per_rank[r][n_dense:] for r in (s, s + 2)))]
                   for s in range(2)]
        want = ref.step(dense + experts[0] + experts[1], max_norm)
        assert want > max_norm
        _set(rep_table, per_rank[rank])
        _set(sh_table, per_rank[rank])
        got_rep = _replicated_step(rep_table, rep_opt, rep_grads, max_norm)
        got_sharded = sharded.step(max_grad_norm=max_norm)
        sharded.zero_grad()
        torch.testing.assert_close(got_rep, want, **TOL)
        torch.testing.assert_close(got_sharded, want, **TOL)
        mine_ref = ref_tables[0] + ref_tables[1 + shard]
        _assert_close(rep_table, mine_ref, **TOL)
        _assert_close(sh_table, mine_ref, **TOL)


@pytest.mark.slow
def test_dp4_ep2_paths_match_naive_clip_and_adamw():
    run_multiprocess(_dp4_ep2_body, 4)
