"""The pipeline's chunk graphs (pipeline/chunk_graphs.py) on CPU.

1. The capture plan against the schedule, for P in {1, 2, 4}, V in {1, 2, 4}, m in {4, 8}:
   microbatches that share a slot never overlap in flight, a chunk has exactly as many slots
   as it has microbatches in flight at the schedule's busiest point (counted independently
   by sweeping the op list), and for the plain 1F1B schedule (V = 1) rank r holds
   min(m, P - r) slots, the published 1F1B in-flight count.
2. The engine replaying ``EagerGraph`` stand-ins (the same slots, static buffers, copies,
   main-gradient sums and forward-state hooks as the CUDA graphs, re-running the recorded body
   at each replay) reproduces the single-process loss and every gradient, over several steps
   with the capture in the middle, at P = 1 (local hops) and P = 2 (gloo). A wrong slot plan
   would overwrite a static input that an in-flight microbatch's backward still reads:
   autograd refuses that (version counter), so these tests fail on it.
The CUDA capture itself runs on an H200 (scripts/gpu_check_chunk_graphs.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineLayout, all_schedules
from pipeline.chunk_graphs import EagerGraph, capture_plan
from tests.multiproc import run_multiprocess
from tests.pipeline.toy_model import build_chunks, make_batch, reference

RTOL, ATOL = 1e-5, 1e-6   # fp32; only summation order differs from the one-process reference

GRID = [(P, V, m) for P in (1, 2, 4) for V in (1, 2, 4) for m in (4, 8)
        if not (V > 1 and (m < P or m % P))]


def _in_flight_peak(ops, chunk):
    """Most microbatches of ``chunk`` between their F and B at any point (independent sweep)."""
    live, peak = 0, 0
    for op in ops:
        if op.chunk == chunk:
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("P,V,m", GRID, ids=[f"P{p}V{v}m{m}" for p, v, m in GRID])
def test_capture_plan_matches_the_schedule(P, V, m):
    schedules = all_schedules(P, V, m)
    for rank, ops in enumerate(schedules):
        plan = capture_plan(ops)
        assert sorted(plan.slots) == [c for c in range(P * V) if c % P == rank]
        for c, slots in plan.slots.items():
            assert len(slots) == m and plan.num_slots[c] == _in_flight_peak(ops, c)
            assert set(slots) == set(range(plan.num_slots[c]))
            for a in range(m):
                for b in range(a + 1, m):
                    if slots[a] == slots[b]:
                        fa, ba = plan.lifetimes[(c, a)]
                        fb, bb = plan.lifetimes[(c, b)]
                        assert ba < fb or bb < fa, (rank, c, a, b)
        assert plan.graphs == 2 * sum(plan.num_slots.values()) and plan.pools == sum(plan.num_slots.values())
        if V == 1:
            assert plan.num_slots == {rank: min(m, P - rank)}


def test_capture_plan_refuses_a_backward_before_its_forward():
    from pipeline import Op
    with pytest.raises(ValueError, match="backward of chunk 0 microbatch 0 before its forward"):
        capture_plan([Op("B", 0, 0)])


def _check_graphed_engine(chunks, produced, local, group, m, steps=4, warmup=1):
    microbatches = make_batch(m)
    ref_loss, ref_grads = reference(chunks, microbatches)
    engine = PipelineEngine(local_chunks=local, num_chunks=len(chunks), produced_blocks=produced,
                            pp_group=group)
    graphs = engine.use_graphs(m, warmup=warmup, graph_factory=EagerGraph)
    for step in range(steps):
        for ch in local.values():
            ch.zero_grad(set_to_none=True)
        loss = engine.train_step(microbatches)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        for c, ch in local.items():
            for n, p in ch.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[c][n], rtol=RTOL, atol=ATOL,
                                           msg=lambda s: f"step {step} chunk {c} {n}: {s}")
        assert graphs.captured == (graphs.plan.graphs if step >= warmup else 0)
    # Evaluation stays eager and agrees.
    torch.testing.assert_close(engine.eval_step(microbatches), ref_loss, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("attnres", [True, False], ids=["attnres", "standard"])
@pytest.mark.parametrize("vpp", [1, 2, 4])
def test_graphed_engine_matches_single_process(vpp, attnres):
    layout = PipelineLayout(8, pp_size=1, vpp_size=vpp)
    chunks, produced = build_chunks(layout, attnres)
    _check_graphed_engine(chunks, produced, dict(enumerate(chunks)), None, m=4)


def _two_ranks(rank, world_size):
    layout = PipelineLayout(8, pp_size=2, vpp_size=2)
    chunks, produced = build_chunks(layout, True)
    local = {c: chunks[c] for c in layout.chunks_of_rank(rank)}
    _check_graphed_engine(chunks, produced, local, dist.group.WORLD, m=4)


@pytest.mark.slow
def test_graphed_engine_on_two_gloo_ranks():
    run_multiprocess(_two_ranks, 2)
