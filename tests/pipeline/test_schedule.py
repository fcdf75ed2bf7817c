import pytest

from pipeline import all_schedules, build_schedule, check_microbatches, num_warmup, schedule_table, simulate

GRIDS = [(2, 2, 4), (2, 3, 6), (4, 2, 8), (3, 2, 6), (2, 1, 3), (1, 3, 2), (4, 3, 12)]


def _megatron_warmup(P, V, m, r):
    w = P - r - 1 if V == 1 else (P - r - 1) * 2 + (V - 1) * P
    return min(w, m * V)


@pytest.mark.parametrize("P,V,m", GRIDS, ids=lambda v: str(v))
def test_schedule(P, V, m):
    C = P * V
    scheds = all_schedules(P, V, m)
    for r, ops in enumerate(scheds):
        mine = [(c, mb) for c in range(r, C, P) for mb in range(m)]
        assert sorted((o.chunk, o.microbatch) for o in ops if o.kind == "F") == mine
        assert sorted((o.chunk, o.microbatch) for o in ops if o.kind == "B") == mine
        # Forwards before the first backward: the warmup plus the first steady-state forward.
        first_b = next(i for i, o in enumerate(ops) if o.kind == "B")
        assert num_warmup(P, V, m, r) == _megatron_warmup(P, V, m, r)
        assert first_b == min(num_warmup(P, V, m, r) + 1, m * V)
        # Cache invariant: chunk c's backward runs before chunk c-P's for the same microbatch.
        pos = {tuple(o): i for i, o in enumerate(ops)}
        for o in ops:
            if o.kind == "B" and o.chunk >= P:
                assert pos[o] < pos[("B", o.chunk - P, o.microbatch)]
    order = simulate(scheds, C)                     # raises on deadlock
    assert len(order) == 2 * m * C
    fwd_only = simulate(all_schedules(P, V, m, forward_only=True), C)
    assert len(fwd_only) == m * C


def test_table_and_group_size():
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                       (3, 0), (4, 0), (3, 1), (4, 1)]
    simulate(all_schedules(2, 2, 5, group_size=3), 4)     # Megatron's PP2 N3 M5 example
    assert num_warmup(2, 2, 5, 0, group_size=3) == 5


@pytest.mark.parametrize("P,V,m,N,match", [
    (2, 2, 3, None, "last group of 1 < P=2"),
    (4, 2, 2, None, "P=4 <= group_size=4 <= microbatches=2"),
    (2, 2, 7, 3, "last group of 1 < P=2"),
    (2, 1, 0, None, "at least one microbatch"),
])
def test_microbatch_rule(P, V, m, N, match):
    with pytest.raises(ValueError, match=match):
        check_microbatches(P, V, m, N)


def test_plain_1f1b_any_m():
    ops = build_schedule(3, 1, 5, 0)
    assert [o.kind for o in ops[:3]] == ["F", "F", "F"]
    simulate(all_schedules(3, 1, 5), 3)
