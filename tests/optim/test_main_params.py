"""bf16 weights with fp32 main parameters and fp32 ``main_grad`` (docs/memory.md#layouts).

(a) Given the same fp32 gradients, the fp32 main parameters step exactly as the fp32 weights of
    the plain optimizer do (``torch.equal``: the same update code on the same fp32 values), for
    AdamW and Muon, replicated (``MainParamOptimizer``) and ZeRO-1 (``ShardedOptimizer``), and
    the bf16 weights are the main parameters rounded to bf16 (``torch.equal`` again).
(b) ``MainGrads`` accumulates m microbatch gradients into exactly the fp32 sum of the
    per-microbatch gradients (each the bf16 gradient widened to fp32, summed in order), which
    bf16 accumulation in ``p.grad`` misses (checked, so the comparison has teeth).
(c) ZeRO-1 at DP=2 with bf16 weights equals DP=1 with bf16 weights: main parameters within
    ``atol=rtol=1e-6`` (the reduce sums the two ranks' gradients in its own order; fp32).
(e, optimizer half) ``state_dtype=bf16`` stores bf16 moments that stay within bf16 rounding of
    the fp32 moments after one step (rel. 2^-8).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from k3train.trainer.optim_state import main_param_values
from optim import MainGrads, MainParamOptimizer, build_optimizer
from optim.grads import GradGroups
from optim.sharded import ShardedOptimizer
from tests.multiproc import run_multiprocess
from tests.optim.helpers import EXPERT_SHAPES, HP, grads_for, make_table, set_grads


def set_main_grads(table, grads) -> None:
    """What ``MainGrads`` leaves after a step's backwards: fp32 ``p.main_grad``."""
    for e, g in zip(table, grads):
        e.param.main_grad = g.clone()


def mains_of(opt) -> list[torch.Tensor]:
    """The whole fp32 main parameter of every table entry (one process)."""
    if isinstance(opt, MainParamOptimizer):
        return list(opt.mains)
    out = {}
    for d in opt.domains:
        for b in d.buckets:
            off = 0
            for p in b.params:
                out[id(p)] = b.main[off:off + p.numel()].view(p.shape)
                off += p.numel()
        for e, _ in d.owned_muon():
            out[id(e.param)] = d.mains[e.name]
    return [out[id(e.param)] for e in opt.table]


# ---- (a) the main-parameter step is the fp32 step ----------------------------------------------
@pytest.mark.parametrize("zero1", [False, True])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_main_param_step_equals_fp32_weights_step(name, zero1):
    table, ref = make_table(0), make_table(0)
    if zero1:
        opt = ShardedOptimizer(table, name=name, param_dtype=torch.bfloat16, **HP)
        ref_opt = ShardedOptimizer(ref, name=name, **HP)
    else:
        opt = MainParamOptimizer(table, param_dtype=torch.bfloat16, name=name, **HP)
        ref_opt = build_optimizer(ref, name, **HP)
    assert all(e.param.dtype == torch.bfloat16 for e in table)
    for step in range(3):
        grads = grads_for(table, 0, step)
        set_main_grads(table, grads)
        set_grads(ref, grads)
        if zero1:
            opt.step(max_grad_norm=None)
            ref_opt.step(max_grad_norm=None)
        else:
            opt.step()
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for e, r, main in zip(table, ref, mains_of(opt)):
            assert main.dtype == torch.float32
            assert torch.equal(main, r.param.detach()), (e.name, step)
            assert torch.equal(e.param.detach(), r.param.detach().bfloat16()), (e.name, step)
    # Teeth: stepping the bf16 weights themselves (no main parameters) ends elsewhere.
    low = make_table(0)
    for e in low:
        e.param.data = e.param.data.bfloat16()
    low_opt = build_optimizer(low, name, **HP)
    for step in range(3):
        set_grads(low, [g.bfloat16() for g in grads_for(low, 0, step)])
        low_opt.step()
    assert any(not torch.equal(e.param.detach().float(), r.param.detach()) for e, r in zip(low, ref))


def test_initial_main_params_keep_the_fp32_initialisation():
    table, ref = make_table(3), make_table(3)
    for opt in (MainParamOptimizer(table, param_dtype=torch.bfloat16, name="muon", **HP),):
        for main, r in zip(opt.mains, ref):
            assert torch.equal(main, r.param.detach())
    sharded_table = make_table(3)
    sharded = ShardedOptimizer(sharded_table, name="muon", param_dtype=torch.bfloat16, **HP)
    for main, r in zip(mains_of(sharded), ref):
        assert torch.equal(main, r.param.detach())


# ---- (b) fp32 accumulation over microbatches ---------------------------------------------------
def test_main_grad_is_the_fp32_sum_of_microbatch_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).bfloat16()
    params = list(model.parameters())
    xs = [torch.randn(32, 16).bfloat16() for _ in range(6)]

    def loss(x):
        return model(x).float().pow(2).mean()

    # Reference: each microbatch's gradient on its own, widened to fp32, summed in order.
    per_mb = [torch.autograd.grad(loss(x), params) for x in xs]
    expected = [sum((g[i].float() for g in per_mb[1:]), per_mb[0][i].float()) for i in range(len(params))]
    bf16_sum = [sum((g[i] for g in per_mb[1:]), per_mb[0][i]) for i in range(len(params))]
    assert any(not torch.equal(a.float(), b) for a, b in zip(bf16_sum, expected)), "no rounding to catch"

    hooks = MainGrads(params=params)
    for x in xs:
        loss(x).backward()
    for p, want in zip(params, expected):
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert torch.equal(p.main_grad, want)
    # clear(): the next step starts again from its first microbatch (the buffer is reused).
    buffer = params[0].main_grad
    hooks.clear()
    assert all(p.main_grad is None for p in params)
    loss(xs[0]).backward()
    assert params[0].main_grad is buffer and torch.equal(params[0].main_grad, per_mb[0][0].float())


def test_main_param_optimizer_steps_only_parameters_a_backward_reached():
    table, ref = make_table(0), make_table(0)
    opt = MainParamOptimizer(table, param_dtype=torch.bfloat16, name="adamw", **HP)
    ref_opt = build_optimizer(ref, "adamw", **HP)
    grads = grads_for(table, 0, 0)
    set_main_grads(table[1:], grads[1:])  # entry 0 got no gradient this step
    set_grads(ref[1:], grads[1:])
    opt.step()
    ref_opt.step()
    assert torch.equal(opt.mains[0], ref[0].param.detach())  # untouched, like torch's AdamW
    assert torch.equal(opt.mains[1], ref[1].param.detach())


# ---- (e) bf16 moments --------------------------------------------------------------------------
@pytest.mark.parametrize("zero1", [False, True])
def test_bf16_state_dtype_keeps_bf16_moments_near_the_fp32_ones(zero1):
    def build(table, state_dtype):
        if zero1:
            return ShardedOptimizer(table, name="muon", param_dtype=torch.bfloat16, state_dtype=state_dtype, **HP)
        return MainParamOptimizer(table, param_dtype=torch.bfloat16, name="muon", state_dtype=state_dtype, **HP)

    low, ref = make_table(0), make_table(0)
    opts = [build(low, torch.bfloat16), build(ref, None)]
    for t, o in zip((low, ref), opts):
        set_main_grads(t, grads_for(t, 0, 0))
        o.step(max_grad_norm=None) if zero1 else o.step()

    def moments(opt):
        if zero1:
            return ([t for d in opt.domains for b in d.buckets for t in (b.exp_avg, b.exp_avg_sq)]
                    + [t for d in opt.domains for t in d.momentum.values()])
        return [v for inner in opt.optimizers for st in inner.state.values() for k, v in st.items() if k != "step"]

    got, want = moments(opts[0]), moments(opts[1])
    assert got and len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
        torch.testing.assert_close(a.float(), b, rtol=2 ** -8, atol=1e-30)
    assert any(not torch.equal(a.float(), b) for a, b in zip(got, want))  # rounded, not fp32 in disguise


# ---- (c) ZeRO-1 DP=2 with bf16 weights = DP=1 with bf16 weights ------------------------------
def _dp2_body(rank: int, world: int) -> None:

    def is_expert(name: str) -> bool:
        return name.startswith("experts.")

    for name in ("adamw", "muon"):
        shapes = {**EXPERT_SHAPES}
        table = make_table(0) + make_table(7, shapes)
        ref = make_table(0) + make_table(7, shapes)
        opt = ShardedOptimizer(table, name=name, param_dtype=torch.bfloat16, is_expert=is_expert,
                               groups=GradGroups(dp=dist.group.WORLD, expert_dp=dist.group.WORLD), **HP)
        ref_opt = ShardedOptimizer(ref, name=name, param_dtype=torch.bfloat16, is_expert=is_expert, **HP)
        assert [d.world for d in opt.domains] == [2, 2]
        for step in range(3):
            set_main_grads(table, grads_for(table, rank, step))
            per_rank = [grads_for(ref, r, step) for r in range(world)]
            set_main_grads(ref, [sum(gs) / world for gs in zip(*per_rank)])
            norm = opt.step(max_grad_norm=3.0)
            ref_norm = ref_opt.step(max_grad_norm=3.0)
            opt.zero_grad()
            ref_opt.zero_grad()
            torch.testing.assert_close(norm, ref_norm, atol=1e-6, rtol=1e-6)
            mains, ref_mains = main_param_values(opt), main_param_values(ref_opt)
            for e, r in zip(table, ref):
                torch.testing.assert_close(mains[id(e.param)], ref_mains[id(r.param)], atol=1e-6, rtol=1e-6,
                                           msg=f"{name} {e.name} step {step}")
                # The shared weights are the rounded mains on every rank.
                assert torch.equal(e.param.detach(), mains[id(e.param)].bfloat16()), e.name
        # The whole values load back into a fresh DP=2 optimizer's shards and weights.
        fresh = make_table(1) + make_table(8, shapes)
        other = ShardedOptimizer(fresh, name=name, param_dtype=torch.bfloat16, is_expert=is_expert,
                                 groups=GradGroups(dp=dist.group.WORLD, expert_dp=dist.group.WORLD), **HP)
        other.load_main_params({id(f.param): mains[id(e.param)] for f, e in zip(fresh, table)})
        loaded = main_param_values(other)
        for f, e in zip(fresh, table):
            assert torch.equal(loaded[id(f.param)], mains[id(e.param)]), f.name
            assert torch.equal(f.param.detach(), e.param.detach()), f.name
        # Each rank holds about half of the fp32 main parameters.
        total = sum(e.param.numel() for e in table) * 4
        assert opt.main_bytes() < 0.75 * total, (opt.main_bytes(), total)


@pytest.mark.slow
def test_zero1_dp2_bf16_weights_equals_dp1():
    run_multiprocess(_dp2_body, 2)


# ---- the bytes per parameter docs/memory.md#layouts states (the memory planner's contract) ----
@pytest.mark.parametrize("zero1", [False, True])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_bytes_per_parameter_are_the_documented_ones(param_dtype, state_dtype, zero1):
    """weights: 4 or 2 B; gradient buffer: 4 B; main parameters: 4 B with bf16 weights, else 0;
    moments: AdamW 2 x (4 or 2) B, Muon 1 x (4 or 2) B (one rank: nothing divided)."""
    table = make_table(0)
    if zero1:
        opt = ShardedOptimizer(table, name="muon", param_dtype=param_dtype, state_dtype=state_dtype, **HP)
    elif param_dtype is not None:
        opt = MainParamOptimizer(table, param_dtype=param_dtype, name="muon", state_dtype=state_dtype, **HP)
    else:
        opt = build_optimizer(table, "muon", state_dtype=state_dtype, **HP)
    for e, g in zip(table, grads_for(table, 0, 0)):  # a real backward: the hooks allocate main_grad
        (e.param * g.to(e.param.dtype)).sum().backward()
    grad_bytes = sum(b.numel() * b.element_size() for b in opt.main_grads.buffers.values()) if param_dtype \
        else sum(e.param.grad.numel() * e.param.grad.element_size() for e in table)
    opt.step(max_grad_norm=None) if zero1 else opt.step()
    weight_bytes = sum(e.param.numel() * e.param.element_size() for e in table)
    if zero1:
        main_bytes, moment_bytes = opt.main_bytes(), opt.state_bytes()
    else:
        main_bytes = sum(m.numel() * m.element_size() for m in opt.mains) if param_dtype else 0
        moment_bytes = sum(v.numel() * v.element_size() for inner in opt.optimizers
                           for st in inner.state.values() for k, v in st.items() if k != "step")
    n = sum(e.param.numel() for e in table)
    n_muon = sum(e.param.numel() for e in table if e.optimizer == "muon")
    w, m = (2 if param_dtype else 4), (2 if state_dtype else 4)
    assert weight_bytes == w * n
    assert grad_bytes == 4 * n
    assert main_bytes == (4 * n if param_dtype else 0)
    assert moment_bytes == 2 * m * (n - n_muon) + m * n_muon
