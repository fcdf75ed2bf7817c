"""Interleaved 1F1B schedule (Megatron's algorithm) as data: per-rank lists of compute ops.

Megatron orders a rank's forward passes by a table of (microbatch, virtual stage) built from
microbatch groups of ``group_size`` (default P): within a group every virtual stage runs the
group's microbatches before the next virtual stage starts. Backward passes walk the same table
with the virtual stages mirrored (last chunk first). A rank runs ``warmup`` forwards, then
alternates one forward and one backward (steady 1F1B), then drains the remaining backwards
(cooldown).
"""
from __future__ import annotations

from typing import NamedTuple


class Op(NamedTuple):
    kind: str        # "F" or "B"
    chunk: int       # global chunk index (c = virtual_stage * P + rank)
    microbatch: int


def check_microbatches(pp_size: int, vpp_size: int, num_microbatches: int, group_size: int | None = None) -> int:
    """Validate m against Megatron's interleaving rule; return the group size used.

    For V > 1 Megatron requires P <= group_size <= m and that the last, partial group is empty
    or holds at least P microbatches (otherwise chunks wait on each other: dependency
    bubbles). With the default group_size = P this means m is a multiple of P and m >= P.
    """
    P, V, m = pp_size, vpp_size, num_microbatches
    if m < 1:
        raise ValueError(f"need at least one microbatch, got {m}")
    N = P if group_size is None else group_size
    if V == 1:
        return N
    if not P <= N <= m:
        raise ValueError(f"interleaved schedule needs P={P} <= group_size={N} <= microbatches={m}")
    rem = m % N
    if 0 < rem < P:
        raise ValueError(f"interleaved schedule: microbatches={m} leaves a last group of {rem} < P={P} "
                         f"(group_size={N}); use a multiple of {N} or a remainder >= {P}")
    return N


def schedule_table(num_microbatches: int, vpp_size: int, group_size: int) -> list[tuple[int, int]]:
    """Forward order of (microbatch, virtual_stage) shared by every rank.

    Groups of ``group_size`` consecutive microbatches; the last group absorbs the remainder.
    E.g. m=5, V=2, group 3: (0,0)(1,0)(2,0)(0,1)(1,1)(2,1)(3,0)(4,0)(3,1)(4,1).
    """
    table = []
    start = 0
    while start < num_microbatches:
        end = start + group_size
        if end >= num_microbatches:
            end = num_microbatches
        table += [(mb, v) for v in range(vpp_size) for mb in range(start, end)]
        start = end
    return table


def num_warmup(pp_size: int, vpp_size: int, num_microbatches: int, rank: int, group_size: int | None = None) -> int:
    """Forwards a rank runs before its first backward (Megatron's count, capped at m*V)."""
    P, V = pp_size, vpp_size
    N = P if group_size is None else group_size
    if V == 1:
        warm = P - rank - 1
    else:
        # Every rank fills (V-1) groups; earlier ranks run 2 more per stage of distance to the
        # last rank so their first backward input has time to come back through the ring.
        warm = (P - rank - 1) * 2 + (V - 1) * N
    return min(warm, num_microbatches * V)


def build_schedule(pp_size: int, vpp_size: int, num_microbatches: int, rank: int,
                   group_size: int | None = None, forward_only: bool = False) -> list[Op]:
    """Compute ops of pipeline ``rank`` in execution order (one readable function, three phases)."""
    P, V, m = pp_size, vpp_size, num_microbatches
    N = check_microbatches(P, V, m, group_size)
    table = schedule_table(m, V, N)
    total = m * V
    fwd = [Op("F", v * P + rank, mb) for mb, v in table]
    if forward_only:
        return fwd
    # Backward mirrors the virtual stage: the k-th backward is the k-th table entry with the
    # last virtual stage first, so chunk c's backward precedes chunk c-P's for a microbatch.
    bwd = [Op("B", (V - 1 - v) * P + rank, mb) for mb, v in table]
    warm = num_warmup(P, V, m, rank, N)

    ops = fwd[:warm]                                   # warmup: forwards only
    for k in range(total - warm):                      # steady state: one forward, one backward
        ops += [fwd[warm + k], bwd[k]]
    ops += bwd[total - warm:]                          # cooldown: drain backwards
    return ops


def all_schedules(pp_size: int, vpp_size: int, num_microbatches: int, group_size: int | None = None,
                  forward_only: bool = False) -> list[list[Op]]:
    return [build_schedule(pp_size, vpp_size, num_microbatches, r, group_size, forward_only)
            for r in range(pp_size)]


def simulate(schedules: list[list[Op]], num_chunks: int) -> list[tuple[int, Op]]:
    """Run per-rank op lists in order with message-passing semantics; return a global order.

    Sends never block and a rank blocks only on the data its next op needs, exactly as the
    engine does. F(c, mb) needs F(c-1, mb); B(c, mb) needs F(c, mb) and B(c+1, mb). Raises
    RuntimeError on deadlock (no rank can make progress), so a schedule that passes cannot
    hang the engine.
    """
    done: set[tuple[str, int, int]] = set()
    pos = [0] * len(schedules)
    order = []
    while any(pos[r] < len(s) for r, s in enumerate(schedules)):
        progressed = False
        for r, sched in enumerate(schedules):
            while pos[r] < len(sched):
                op = sched[pos[r]]
                if op.kind == "F":
                    ready = op.chunk == 0 or ("F", op.chunk - 1, op.microbatch) in done
                else:
                    ready = ("F", op.chunk, op.microbatch) in done and (
                        op.chunk == num_chunks - 1 or ("B", op.chunk + 1, op.microbatch) in done)
                if not ready:
                    break
                done.add(tuple(op))
                order.append((r, op))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: schedules[r][pos[r]] for r in range(len(schedules)) if pos[r] < len(schedules[r])}
            raise RuntimeError(f"schedule deadlocks; next ops per rank: {stuck}")
    return order
