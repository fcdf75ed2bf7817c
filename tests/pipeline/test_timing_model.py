"""The timing model against hand-computed closed forms and hand-traced small schedules."""
import random

import pytest

from pipeline import all_schedules, build_plan, predicted_bytes
from pipeline.timing_model import (LinkCost, Message, OpCosts, hop_messages, interleaved_closed_form,
                                   predict_step)

# (P, V, m) with m a multiple of P: Megatron's default group size.
CLOSED = [(1, 1, 4), (2, 1, 8), (4, 1, 8), (8, 1, 8), (2, 2, 8), (4, 2, 8), (4, 4, 16), (3, 3, 6),
          (8, 2, 16), (2, 4, 6)]


@pytest.mark.parametrize("P,V,m", CLOSED, ids=str)
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (0.5, 1.5)])
def test_step_equals_closed_form(P, V, m, f, b):
    pred = predict_step(P, V, m, OpCosts.uniform(P * V, f, b))
    assert pred.step_s == pytest.approx(interleaved_closed_form(P, V, m, f, b), rel=1e-12)
    # Idle share of the step: the (P-1)(f+b) of fill and drain against V*m*(f+b) of work.
    assert pred.bubble == pytest.approx((P - 1) / (V * m + P - 1), rel=1e-12)
    # ... which is the textbook ratio (P-1)/(V*m) when measured against the ideal time.
    assert (pred.step_s - V * m * (f + b)) / (V * m * (f + b)) == pytest.approx(pred.bubble_theory)


def test_v1_classic_form():
    pred = predict_step(4, 1, 8, OpCosts.uniform(4, 1.0, 2.0))
    assert pred.step_s == pytest.approx((8 + 4 - 1) * 3.0)


def test_latency_adds_on_two_rank_chain():
    f, b, lat = 1.0, 2.0, 0.25
    link = LinkCost(latency_s=lat)
    # One microbatch: F0 -> hop -> F1 -> B1 -> hop -> B0, every step on the critical path.
    pred = predict_step(2, 1, 1, OpCosts.uniform(2, f, b), link=link)
    assert pred.step_s == pytest.approx(2 * (f + b) + 2 * lat)
    # Bandwidth term: bytes / bandwidth on each of the two crossings; per-tensor cost too.
    link = LinkCost(latency_s=lat, bandwidth_Bps=1000.0, per_tensor_s=0.01)
    msgs = [Message(nbytes=500, tensors=3)]
    pred = predict_step(2, 1, 1, OpCosts.uniform(2, f, b), msgs, link)
    assert pred.step_s == pytest.approx(2 * (f + b) + 2 * (lat + 0.03 + 0.5))


def test_link_serialises_and_blocking_sends():
    # Hand trace, P=2 V=1 m=2, f=b=1, every message 10: rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1.
    costs, link = OpCosts.uniform(2, 1.0, 1.0), LinkCost(latency_s=10.0)
    # Overlapped: the second forward message waits for the link (11 -> 21); B1's reply leaves
    # at 23 behind B0's (13 -> 23) and arrives at 33; rank 0's last backward ends at 34.
    assert predict_step(2, 1, 2, costs, link=link).step_s == pytest.approx(34.0)
    # Blocking sends: each sender is busy until its message arrives; last reply 25 -> 35, end 36.
    assert predict_step(2, 1, 2, costs, link=link, overlap_sends=False).step_s == pytest.approx(36.0)


def test_host_overheads_are_serial():
    f, b = 1.0, 2.0
    pred = predict_step(2, 1, 1, OpCosts.uniform(2, f, b, op_overhead_s=0.1, recv_overhead_s=0.3))
    # Four ops on the critical path (0.1 each), two of them consume a message (F1, B0).
    assert pred.step_s == pytest.approx(2 * (f + b) + 4 * 0.1 + 2 * 0.3)
    assert pred.compute_s == [f + b, f + b]


GRIDS = [(2, 2, 4), (2, 3, 6), (4, 2, 8), (3, 2, 6), (2, 1, 3), (1, 3, 2), (4, 3, 12), (4, 1, 6),
         (2, 3, 4)]


@pytest.mark.parametrize("P,V,m", GRIDS, ids=str)
@pytest.mark.parametrize("overlap", [True, False])
def test_never_deadlocks_and_respects_dependencies(P, V, m, overlap):
    rng = random.Random(P * 100 + V * 10 + m)
    C = P * V
    costs = OpCosts(tuple(rng.uniform(0.5, 2) for _ in range(C)), tuple(rng.uniform(1, 4) for _ in range(C)))
    msgs = [Message(rng.randint(0, 100), rng.randint(1, 4)) for _ in range(C - 1)]
    link = LinkCost(latency_s=0.1, bandwidth_Bps=200.0, per_tensor_s=0.01)
    pred = predict_step(P, V, m, costs, msgs, link, overlap_sends=overlap)
    ends = {}
    for r, spans in enumerate(pred.spans):
        assert [op for op, _, _ in spans] == all_schedules(P, V, m)[r]
        for (_, _, e0), (_, s1, _) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-12                      # a rank runs one op at a time
        ends.update({tuple(op): (s, e) for op, s, e in spans})
    for (kind, c, mb), (s, e) in ends.items():
        assert e - s == pytest.approx(costs.fwd_s[c] if kind == "F" else costs.bwd_s[c])
        if kind == "F" and c > 0 and P > 1:
            assert s >= ends[("F", c - 1, mb)][1] + link.time(msgs[c - 1].nbytes, msgs[c - 1].tensors) - 1e-9
        if kind == "B" and c < C - 1:
            assert s >= ends[("B", c + 1, mb)][1] - 1e-12
    assert 0 <= pred.bubble < 1


def test_hop_messages_match_engine_prediction():
    produced = [[0, 1], [], [2], [3], [], [4]]
    for transport in ("cached", "naive"):
        plan = build_plan(produced, 2, transport)
        msgs = hop_messages(plan, block_bytes=64, hidden_bytes=32)
        pred = predicted_bytes(plan, 64, 32, 3)
        assert 3 * sum(x.nbytes for x in msgs) == pred["total_fwd"]
        assert [x.tensors for x in msgs] == [len(h) + 1 for h in plan.hops]


def test_bad_inputs():
    with pytest.raises(ValueError, match="costs cover 3 chunks; P=2 x V=2 has 4"):
        predict_step(2, 2, 4, OpCosts.uniform(3, 1, 1))
    with pytest.raises(ValueError, match="messages cover 1 hops"):
        predict_step(2, 2, 4, OpCosts.uniform(4, 1, 1), [Message(1, 1)])
    with pytest.raises(ValueError, match="fwd_s has 2 chunks, bwd_s 1"):
        OpCosts((1.0, 1.0), (1.0,))
