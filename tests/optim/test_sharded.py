"""ShardedOptimizer (ZeRO-1): DP-sharded steps equal the unsharded step on the averaged gradient.

Tolerance: parameters and norms agree within ``atol=1e-5, rtol=1e-5`` (fp32). Bit-exactness
is not expected in general: the collectives sum the ranks' gradients and norm squares in
their own order. Resume from a state_dict is compared bitwise (same ops, same order).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from optim import build_optimizer
from optim.grads import GradGroups
from optim.sharded import ShardedOptimizer, plan_muon_owners
from tests.multiproc import run_multiprocess
from tests.optim.helpers import HP, SHAPES, EXPERT_SHAPES, make_table, grads_for, set_grads

TOL = dict(atol=1e-5, rtol=1e-5)


def is_expert(name: str) -> bool:
    return name.startswith("experts.")


def averaged(table, ranks, step: int, salt: int = 0, dp: int | None = None) -> list[torch.Tensor]:
    """The reduced gradient (``optim.grads``' convention): the sum of the gradients of ``ranks``
    (the copies of the parameters) divided by the DP size ``dp`` (default: ``len(ranks)``)."""
    per_rank = [grads_for(table, r, step, salt) for r in ranks]
    return [sum(gs) / (dp or len(ranks)) for gs in zip(*per_rank)]


def clip_reference(grads: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
    if max_norm:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)
    return norm


def sharded(table, name: str, dp) -> ShardedOptimizer:
    """A ShardedOptimizer over the DP group ``dp`` with the test's hyper-parameters."""
    return ShardedOptimizer(table, name=name, groups=GradGroups(dp=dp), **HP)


def assert_params_close(table, ref_table, **tol) -> None:
    for e, r in zip(table, ref_table):
        torch.testing.assert_close(e.param.detach(), r.param.detach(), msg=e.name, **(tol or TOL))


# ---- single process -------------------------------------------------------------------------
def test_plan_balanced_and_deterministic():
    rng = random.Random(0)
    for world in (1, 2, 3, 8):
        numels = [rng.randint(1, 5000) for _ in range(37)]
        owners = plan_muon_owners(numels, world)
        assert owners == plan_muon_owners(list(numels), world)
        load = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world)]
        assert max(load) <= min(load) + max(numels), (world, load)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_single_rank_matches_torch_adamw_and_combined(name):
    """Without torch.distributed the optimizer is one rank owning everything: its AdamW must
    equal torch.optim.AdamW and the whole step must equal build_optimizer's."""
    table, ref = make_table(0), make_table(0)
    opt = ShardedOptimizer(table, name=name, **HP)
    ref_opt = build_optimizer(ref, name, **HP)
    assert any(isinstance(o, torch.optim.AdamW) for o in ref_opt.optimizers)
    for step in range(3):
        grads = grads_for(table, 0, step)
        set_grads(table, grads)
        set_grads(ref, grads)
        norm = opt.step(max_grad_norm=5.0)
        ref_norm = clip_reference([e.param.grad for e in ref], 5.0)
        ref_opt.step()
        torch.testing.assert_close(norm, ref_norm, **TOL)
        assert_params_close(table, ref, atol=1e-6, rtol=1e-6)
    assert opt.reduces_gradients
    assert [g["base_lr"] for g in opt.param_groups] == [g["base_lr"] for g in ref_opt.param_groups]


# ---- DP=2 --------------------------------------------------------------------------------
def _dp2_body(rank: int, world: int) -> None:
    dp = dist.group.WORLD
    for name in ("adamw", "muon"):
        for max_norm in (None, 3.0):  # 3.0 is below the averaged norm (~7): clipping is active
            table, ref = make_table(0), make_table(0)
            opt = sharded(table, name, dp)
            ref_opt = build_optimizer(ref, name, **HP)
            for step in range(3):
                set_grads(table, grads_for(table, rank, step))
                set_grads(ref, averaged(ref, range(world), step))
                norm = opt.step(max_grad_norm=max_norm)
                ref_norm = clip_reference([e.param.grad for e in ref], max_norm)
                assert max_norm is None or ref_norm > max_norm
                ref_opt.step()
                opt.zero_grad()
                torch.testing.assert_close(norm, ref_norm, **TOL)
                assert_params_close(table, ref)
            # Memory: this rank holds about half of the unsharded state.
            ref_bytes = sum(t.numel() * t.element_size() for o in ref_opt.optimizers
                            for s in o.state.values() for t in s.values() if t.ndim > 0)
            all_bytes = [None] * world
            dist.all_gather_object(all_bytes, opt.state_bytes())
            assert ref_bytes <= sum(all_bytes) <= ref_bytes + 4 * 2 * world  # + fp32 padding
            assert max(all_bytes) < 0.75 * ref_bytes, (all_bytes, ref_bytes)

    # The ownership plan: identical on all ranks, balanced, covering every Muon matrix.
    table = make_table(0)
    opt = sharded(table, "muon", dp)
    plan = opt.state_dict()["layout"]["muon_owners"]["dense"]
    plans = [None] * world
    dist.all_gather_object(plans, plan)
    assert plans == [plan] * world and {o for _, o in plan} == {0, 1}
    sizes = {e.name: e.param.numel() for e in table}
    load = [sum(sizes[n] for n, o in plan if o == r) for r in range(world)]
    assert max(load) <= min(load) + max(sizes[n] for n, _ in plan)

    # Resume: 2 steps, save, fresh parameters + optimizer load it, step 3 equals uninterrupted.
    for name in ("adamw", "muon"):
        table, ref = make_table(0), make_table(0)
        opt, ref_opt = sharded(table, name, dp), sharded(ref, name, dp)
        for step in range(3):
            for t, o in ((table, opt), (ref, ref_opt)):
                if step < 2 or o is ref_opt:
                    set_grads(t, grads_for(t, rank, step))
                    o.step(max_grad_norm=3.0)
            if step == 1:
                saved, saved_params = opt.state_dict(), [e.param.detach().clone() for e in table]
                table = make_table(7)  # other values: everything must come from the checkpoint
                with torch.no_grad():
                    for e, p in zip(table, saved_params):
                        e.param.copy_(p)
                opt = sharded(table, name, dp)
                opt.load_state_dict(saved)
        set_grads(table, grads_for(table, rank, 2))
        opt.step(max_grad_norm=3.0)
        for e, r in zip(table, ref):
            assert torch.equal(e.param, r.param), e.name

    # A different layout is refused, naming what differs.
    solo = [dist.new_group([r]) for r in range(world)]  # every rank must create every group
    one = sharded(make_table(0), "muon", solo[rank])
    with pytest.raises(ValueError, match="DP size mismatch.*dp_size=2.*dp_size=1"):
        one.load_state_dict(saved)
    other = sharded(make_table(0, {**SHAPES, "norm.weight": (9,)}), "muon", dp)
    with pytest.raises(ValueError, match="entry .*norm.weight"):
        other.load_state_dict(saved)


@pytest.mark.slow
def test_dp2_matches_single_process():
    run_multiprocess(_dp2_body, 2)


# ---- PP=2 x DP=2, and experts over an expert-DP group -------------------------------------
def _pp_dp_body(rank: int, world: int) -> None:
    # Ranks 0,1 are stage 0 and 2,3 stage 1; DP groups {0,1},{2,3}; pipeline groups {0,2},{1,3}.
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stage, dp_ranks = rank // 2, [[0, 1], [2, 3]]
    for name in ("adamw", "muon"):
        table = make_table(stage)  # the two stages hold different parameters
        groups = GradGroups(dp=dp_groups[stage], pp=pp_groups[rank % 2])
        opt = ShardedOptimizer(table, name=name, groups=groups, **HP)
        refs = [make_table(s) for s in range(2)]  # the whole model in one process
        ref_opts = [build_optimizer(r, name, **HP) for r in refs]
        for step in range(3):
            set_grads(table, grads_for(table, rank, step))
            for s in range(2):
                set_grads(refs[s], averaged(refs[s], dp_ranks[s], step))
            norm = opt.step(max_grad_norm=4.0)
            ref_norm = clip_reference([e.param.grad for r in refs for e in r], 4.0)
            assert ref_norm > 4.0
            for o in ref_opts:
                o.step()
            opt.zero_grad()
            torch.testing.assert_close(norm, ref_norm, **TOL)
            assert_params_close(table, refs[stage])

    # Experts: dense parameters over DP=4, experts over expert-DP groups {0,2},{1,3} (EP=2, so
    # ranks 0,2 hold expert shard 0 and ranks 1,3 shard 1). The norm covers every expert once.
    # An expert's gradient is summed over its two copies and divided by the DP size 4 (each
    # rank's expert gradient already holds its EP group's tokens: optim.grads' convention).
    edp_groups, edp_ranks = pp_groups, [[0, 2], [1, 3]]
    ep = rank % 2
    dense, experts = make_table(0), make_table(10 + ep, EXPERT_SHAPES)
    opt = ShardedOptimizer(dense + experts, name="muon", is_expert=is_expert, **HP,
                           groups=GradGroups(dp=dist.group.WORLD, expert_dp=edp_groups[ep]))
    assert [d.world for d in opt.domains] == [4, 2]
    ref_dense = make_table(0)
    ref_experts = [make_table(10 + s, EXPERT_SHAPES) for s in range(2)]
    ref_opt = build_optimizer(ref_dense + ref_experts[0] + ref_experts[1], "muon", **HP)
    for step in range(2):
        set_grads(dense, grads_for(dense, rank, step))
        set_grads(experts, grads_for(experts, rank, step, salt=5))
        set_grads(ref_dense, averaged(ref_dense, range(4), step))
        for s in range(2):
            set_grads(ref_experts[s], averaged(ref_experts[s], edp_ranks[s], step, salt=5, dp=4))
        norm = opt.step(max_grad_norm=4.0)
        ref_norm = clip_reference([e.param.grad for t in (ref_dense, *ref_experts) for e in t], 4.0)
        ref_opt.step()
        opt.zero_grad()
        torch.testing.assert_close(norm, ref_norm, **TOL)
        assert_params_close(dense + experts, ref_dense + ref_experts[ep])


@pytest.mark.slow
def test_pp2_dp2_and_expert_groups_match_single_process():
    run_multiprocess(_pp_dp_body, 4)


# ---- ZeRO-1 spreads Newton-Schulz: each rank orthogonalises only the matrices it owns -------
def _ownership_body(rank: int, world: int) -> None:
    import optim.sharded as sharded_mod

    table = make_table(0)
    opt = sharded(table, "muon", dist.group.WORLD)
    seen: list[str] = []
    real = sharded_mod.muon_updates

    def spy(grads, bufs, **kw):
        seen.extend(next(e.name for e in table if e.param.grad is g) for g in grads)
        return real(grads, bufs, **kw)

    sharded_mod.muon_updates = spy
    try:
        set_grads(table, grads_for(table, rank, 0))
        opt.step(max_grad_norm=None)
    finally:
        sharded_mod.muon_updates = real
    muon = [e for e in table if e.optimizer == "muon"]
    owners = plan_muon_owners([e.param.numel() for e in muon], world)
    assert sorted(seen) == sorted(e.name for e, o in zip(muon, owners) if o == rank)
    everyone = [None] * world
    dist.all_gather_object(everyone, seen)
    flat = [n for names in everyone for n in names]
    assert sorted(flat) == sorted(e.name for e in muon) and len(set(flat)) == len(flat)  # a partition
    assert all(everyone), "every rank owns at least one matrix in this table"


@pytest.mark.slow  # two spawned processes: ~10 s alone, far more on a shared CI machine
def test_zero1_each_rank_orthogonalises_only_its_own_matrices():
    run_multiprocess(_ownership_body, 2)
