"""Distributed Muon: Newton-Schulz once per matrix block per data-parallel group, same update.

Reference: the replicated ``Muon`` (``build_optimizer`` without ``muon_group_of``) stepping the
same reduced gradients in the same process. Everything is fp64 (Newton-Schulz keeps fp64), and
parameters agree within ``atol=1e-12, rtol=0`` after three steps: the blocks go through the same
operations, only stacked in other batches. ZeRO-1 (``ShardedOptimizer``, which already owns
whole matrices) is held to the same tolerance against the replicated step on the averaged
gradients. Ranks run on gloo (``tests/multiproc.py``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import optim.muon_distributed as md
from k3train.model.model import build_model
from k3train.trainer.optimizer import muon_ns_flops_per_rank
from optim import build_optimizer, build_param_table
from optim.grads import GradGroups
from optim.muon import ns_flops
from optim.muon_distributed import gather_bytes, muon_blocks, ns_flops_per_rank, plan_ns_owners
from optim.sharded import ShardedOptimizer
from tests.helpers import tiny_cfg
from tests.multiproc import run_multiprocess
from tests.optim.helpers import EXPERT_SHAPES, HP, RULES, SHAPES

TOL = dict(atol=1e-12, rtol=0.0)
ADAMW_FP32_TOL = dict(atol=1e-6, rtol=1e-6)
STEPS = 3


def fp64_table(seed: int, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)))
             for n, s in shapes.items()]
    return build_param_table(named, RULES)


def grads(table, rank: int, step: int, salt: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + salt)
    return [torch.randn(e.shape, generator=gen, dtype=torch.float64) for e in table]


def set_grads(table, gs) -> None:
    for e, g in zip(table, gs):
        e.param.grad = g.clone()


def assert_same(table, ref, zero1: bool = False) -> None:
    for e, r in zip(table, ref):
        # ZeRO-1 runs AdamW in fp32 by design (fp32 moments): its AdamW parameters agree at fp32
        # rounding; every Muon parameter, and everything on the replicated path, at fp64's.
        tol = ADAMW_FP32_TOL if zero1 and e.optimizer == "adamw" else TOL
        torch.testing.assert_close(e.param.detach(), r.param.detach(), msg=lambda m: f"{e.name}: {m}", **tol)


def mean(gs_per_rank: list[list[torch.Tensor]], dp: int) -> list[torch.Tensor]:
    return [sum(gs) / dp for gs in zip(*gs_per_rank)]


# ---- single process -------------------------------------------------------------------------
def test_plan_balances_flops_and_is_deterministic():
    costs = [ns_flops(r, c) for r, c in [(64, 64), (8, 64), (32, 16), (64, 8), (16, 16)] * 3]
    for world in (1, 2, 3, 4):
        owners = plan_ns_owners(costs, world)
        assert owners == plan_ns_owners(list(costs), world)  # no hidden state
        load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        assert max(load) - min(load) <= max(costs), (world, load)
        assert sum(load) == sum(costs)


def test_flops_and_bytes_accounting_by_hand():
    # ns_flops on [a, b], a <= b: 5 steps of 4 a^2 b + 2 a^3; orientation does not matter.
    assert ns_flops(8, 32) == ns_flops(32, 8) == 5 * (4 * 64 * 32 + 2 * 512)
    assert muon_blocks((16, 8), 4) == (4, 4, 8) and muon_blocks((3, 8, 6), None) == (3, 8, 6)
    mats = [((16, 8), 4), ((2, 8, 6), None)]  # 4 blocks [4, 8] and 2 blocks [8, 6]
    total = 4 * ns_flops(4, 8) + 2 * ns_flops(8, 6)
    assert ns_flops_per_rank(mats, 2, distributed=False) == [total, total]
    per = ns_flops_per_rank(mats, 2)
    assert sum(per) == total and per == [ns_flops(8, 6) + 2 * ns_flops(4, 8)] * 2
    # Each rank holds one [8, 6] and two [4, 8] blocks: 48 + 64 = 112 elements; receives 1 share.
    assert gather_bytes(mats, 2, element_size=2) == 112 * 2
    assert gather_bytes(mats, 1, element_size=2) == 0


def test_one_rank_equals_replicated_bitwise():
    table, ref = fp64_table(0), fp64_table(0)
    opt = build_optimizer(table, "muon", **HP, muon_group_of=lambda p: None)
    ref_opt = build_optimizer(ref, "muon", **HP)
    assert type(opt.optimizers[0]).__name__ == "DistributedMuon"
    for step in range(STEPS):
        set_grads(table, grads(table, 0, step))
        set_grads(ref, grads(ref, 0, step))
        opt.step()
        ref_opt.step()
    for e, r in zip(table, ref):
        assert torch.equal(e.param, r.param), e.name
    # The state is the replicated Muon's: it loads into either.
    ref_opt.load_state_dict(opt.state_dict())


# ---- gloo: DP = 2, 4; EP = 2 x DP = 2; ZeRO-1 -----------------------------------------------
def _count_ns(fn):
    """Run ``fn()`` counting the Newton-Schulz blocks this rank orthogonalises."""
    seen, real = [], md.newton_schulz

    def spy(G, *a, **kw):
        seen.append(G.shape[0])
        return real(G, *a, **kw)

    md.newton_schulz = spy
    try:
        fn()
    finally:
        md.newton_schulz = real
    return sum(seen)


def _dp_body(rank: int, world: int) -> None:
    # One all-gather for the whole table; then a cap of 200 elements, which cuts the three Muon
    # matrices (128, 192 and 192 elements) into three rounds of one all-gather each.
    for cap in (md._ROUND_ELEMS, 200):
        md._ROUND_ELEMS = cap
        table, ref = fp64_table(0), fp64_table(0)
        opt = build_optimizer(table, "muon", **HP, muon_group_of=lambda p: dist.group.WORLD)
        ref_opt = build_optimizer(ref, "muon", **HP)
        blocks = 0
        for step in range(STEPS):
            g = grads(table, 0, step)  # already reduced: the same on every rank
            set_grads(table, g)
            set_grads(ref, g)
            blocks += _count_ns(opt.step)
            ref_opt.step()
            assert_same(table, ref)
        # The blocks form a partition: each orthogonalised once per step across the group.
        total = sum(muon_blocks(e.shape, e.heads)[0] for e in table if e.optimizer == "muon")
        counts = [None] * world
        dist.all_gather_object(counts, blocks)
        assert sum(counts) == STEPS * total and all(counts), counts
        rounds = [len(r) for _, r in opt.optimizers[0]._plans.values()]
        assert rounds == ([1] if cap > 1000 else [3]), rounds

    # ZeRO-1: every rank its own gradient; the reference steps their mean.
    table, ref = fp64_table(1), fp64_table(1)
    opt = ShardedOptimizer(table, name="muon", groups=GradGroups(dp=dist.group.WORLD), **HP)
    ref_opt = build_optimizer(ref, "muon", **HP)
    for step in range(STEPS):
        set_grads(table, grads(table, rank, step))
        set_grads(ref, mean([grads(ref, r, step) for r in range(world)], world))
        opt.step(max_grad_norm=None)
        ref_opt.step()
        assert_same(table, ref, zero1=True)


@pytest.mark.slow  # forked gloo ranks: a few seconds alone, more on a shared machine
@pytest.mark.parametrize("world", [2, 4])
def test_dp_equals_replicated(world):
    run_multiprocess(_dp_body, world)


def _ep_body(rank: int, world: int) -> None:
    # Megatron's layout: EP groups {0,1},{2,3} (ranks r, r+1 hold different experts), expert-DP
    # groups {0,2},{1,3} (the copies of one expert shard); dense weights over all 4 ranks.
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep = rank % 2
    for zero1 in (False, True):
        dense, experts = fp64_table(0), fp64_table(10 + ep, EXPERT_SHAPES)
        expert_ids = {id(e.param) for e in experts}
        names = {e.name for e in experts}
        ref = fp64_table(0) + fp64_table(10 + ep, EXPERT_SHAPES)
        ref_opt = build_optimizer(ref, "muon", **HP)
        if zero1:
            opt = ShardedOptimizer(dense + experts, name="muon", is_expert=names.__contains__, **HP,
                                   groups=GradGroups(dp=dist.group.WORLD, expert_dp=edp_groups[ep]))
        else:
            opt = build_optimizer(dense + experts, "muon", **HP, muon_group_of=lambda p: (
                edp_groups[ep] if id(p) in expert_ids else dist.group.WORLD))
        blocks = 0
        for step in range(STEPS):
            if zero1:  # per-rank gradients, reduced by the optimizer (optim.grads' convention)
                set_grads(dense, grads(dense, rank, step))
                set_grads(experts, grads(experts, rank, step, salt=5))
                mine = [r for r in range(4) if r % 2 == ep]
                set_grads(ref, mean([grads(dense, r, step) for r in range(4)], 4)
                          + mean([grads(experts, r, step, salt=5) for r in mine], 4))
                opt.step(max_grad_norm=None)
            else:  # already reduced: the same within each group
                g = grads(dense, 0, step) + grads(experts, ep, step, salt=5)
                set_grads(dense + experts, g)
                set_grads(ref, g)
                blocks += _count_ns(opt.step)
            ref_opt.step()
            assert_same(dense + experts, ref, zero1)
        if not zero1:
            # Per step: each dense block once over 4 ranks, each expert block once per
            # expert-DP pair (two pairs, different experts).
            n_dense = sum(muon_blocks(e.shape, e.heads)[0] for e in dense if e.optimizer == "muon")
            n_exp = sum(muon_blocks(e.shape, e.heads)[0] for e in experts if e.optimizer == "muon")
            counts = [None] * world
            dist.all_gather_object(counts, blocks)
            assert sum(counts) == STEPS * (n_dense + 2 * n_exp), counts


@pytest.mark.slow
def test_ep2_dp2_experts_over_expert_dp_equal_replicated():
    run_multiprocess(_ep_body, 4)


def test_model_flops_per_rank_replicated_vs_distributed(world1):
    cfg = tiny_cfg("optim.name=muon")
    with torch.device("meta"):
        model = build_model(cfg)
    (full,) = muon_ns_flops_per_rank(model, cfg.optim, dp=1)
    assert full > 0 and muon_ns_flops_per_rank(model, cfg.optim, dp=1, distributed=False) == [full]
    for dp in (2, 4):
        assert muon_ns_flops_per_rank(model, cfg.optim, dp=dp, distributed=False) == [full] * dp
        per = muon_ns_flops_per_rank(model, cfg.optim, dp=dp)
        assert sum(per) == full and max(per) < full / dp * 1.25, per
    # EP=2 at DP=2: one expert-DP copy, so each rank runs its own experts' blocks; the dense
    # blocks still split in two.
    per = muon_ns_flops_per_rank(model, cfg.optim, dp=2, ep=2)
    assert full < sum(per) < 2 * full and max(per) < full, per
    assert muon_ns_flops_per_rank(model, cfg.optim.model_copy(update={"name": "adamw"}), dp=2) == [0, 0]
