"""A timing model of the pipeline step: the schedule replayed as a discrete-event simulation.

Inputs:
* ``OpCosts``: the compute time of the forward and the backward of every global chunk (seconds,
  one microbatch), plus fixed host costs the engine pays per op and per received message;
* ``LinkCost``: what one p2p message costs, ``latency + per_tensor * tensors + bytes / bandwidth``;
* the messages of each hop (``hop_messages``: bytes and tensor count per microbatch, from the
  engine's own byte prediction, ``pipeline.transport.predicted_bytes``);
* the schedule (``pipeline.schedule.all_schedules``).

Each rank runs its ops in order. An op starts when its rank is free and its input message has
arrived: F(c, mb) needs hop c-1's forward message, B(c, mb) hop c's backward message. A message
leaves when its producing op ends; messages between one ordered pair of ranks go one after
another (the link is busy while one is in flight). With ``overlap_sends=False`` the sending rank
also stays busy until its message has arrived (a blocking send).

The result (``Prediction``) holds the step time, each op's span, and the bubble as the engine's
recorder measures it: idle compute time / (step time * P).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.schedule import Op, all_schedules
from pipeline.transport import TransportPlan, predicted_bytes


@dataclass(frozen=True)
class LinkCost:
    """Cost of one p2p message: ``latency_s + per_tensor_s * tensors + nbytes / bandwidth_Bps``.

    per_tensor_s: the extra cost of each tensor in a message (the engine sends one ``isend`` per
    tensor; a packed message has one tensor).
    """

    latency_s: float = 0.0
    bandwidth_Bps: float = float("inf")
    per_tensor_s: float = 0.0

    def time(self, nbytes: int, tensors: int = 1) -> float:
        return self.latency_s + self.per_tensor_s * tensors + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class OpCosts:
    """Per-chunk compute times of one microbatch (seconds); ``fwd_s[c]``, ``bwd_s[c]`` for global
    chunk c (len C = P*V).

    op_overhead_s: host time the rank spends per op besides the compute (launches, engine
    bookkeeping), serial with it.
    recv_overhead_s: host time per op that consumes a message (waiting on it synchronises the
    host, so the next op's launch latency is exposed), serial with it.
    """

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    op_overhead_s: float = 0.0
    recv_overhead_s: float = 0.0

    def __post_init__(self):
        if len(self.fwd_s) != len(self.bwd_s):
            raise ValueError(f"fwd_s has {len(self.fwd_s)} chunks, bwd_s {len(self.bwd_s)}")

    @classmethod
    def uniform(cls, num_chunks: int, fwd_s: float, bwd_s: float, **kw) -> "OpCosts":
        return cls((fwd_s,) * num_chunks, (bwd_s,) * num_chunks, **kw)


@dataclass(frozen=True)
class Message:
    """One hop's message for one microbatch (the backward mirrors the forward's tensors)."""

    nbytes: int
    tensors: int


def hop_messages(plan: TransportPlan, block_bytes: int, hidden_bytes: int,
                 has_hidden: list[bool] | None = None) -> list[Message]:
    """Per-hop message of one microbatch (len C-1) from the engine's byte prediction."""
    pred = predicted_bytes(plan, block_bytes, hidden_bytes, 1, has_hidden)
    return [Message(h["block_bytes"] + h["hidden_bytes"], len(h["blocks"]) + (h["hidden_bytes"] > 0))
            for h in pred["per_hop"]]


@dataclass
class Prediction:
    """step_s: last op end (the step starts at 0). spans[r]: (op, start_s, end_s) in r's order.
    compute_s[r]: r's pure compute time (no host overheads); bubble: idle / (step * P)."""

    pp_size: int
    vpp_size: int
    num_microbatches: int
    step_s: float
    spans: list[list[tuple[Op, float, float]]] = field(repr=False)
    compute_s: list[float] = field(repr=False)

    @property
    def bubble(self) -> float:
        return 1 - sum(self.compute_s) / (self.step_s * self.pp_size) if self.step_s > 0 else 0.0

    @property
    def bubble_theory(self) -> float:
        """The textbook (P-1)/(V*m): bubble time over ideal time, not idle over the step."""
        return (self.pp_size - 1) / (self.vpp_size * self.num_microbatches)


def predict_step(pp_size: int, vpp_size: int, num_microbatches: int, costs: OpCosts,
                 messages: list[Message] | None = None, link: LinkCost | None = None,
                 overlap_sends: bool = True, group_size: int | None = None) -> Prediction:
    """Replay the interleaved 1F1B schedule with ``costs`` and predict one training step.

    messages: per hop (len C-1); None means zero-byte one-tensor messages. link: None means free
    communication. Raises RuntimeError if the schedule deadlocks (it cannot for schedules
    ``all_schedules`` builds; the tests check all small ones).
    """
    P, V, m = pp_size, vpp_size, num_microbatches
    C = P * V
    if len(costs.fwd_s) != C:
        raise ValueError(f"costs cover {len(costs.fwd_s)} chunks; P={P} x V={V} has {C}")
    link = link or LinkCost()
    messages = messages if messages is not None else [Message(0, 1)] * (C - 1)
    if len(messages) != C - 1:
        raise ValueError(f"messages cover {len(messages)} hops; C={C} chunks have {C - 1}")
    schedules = all_schedules(P, V, m, group_size)
    arrival: dict[tuple[str, int, int], float] = {}     # (dir, hop, mb) -> arrival time
    link_free: dict[tuple[int, int], float] = {}        # (src, dst) -> when the link is free
    free = [0.0] * P
    pos = [0] * P
    spans: list[list[tuple[Op, float, float]]] = [[] for _ in range(P)]
    compute = [0.0] * P

    def send(src: int, direction: str, hop: int, mb: int, t: float) -> float:
        """Queue a message at time t; returns when it has arrived."""
        if P == 1:                       # chunks of one rank hand over in memory
            arrival[(direction, hop, mb)] = t
            return t
        dst = (hop + 1) % P if direction == "fwd" else hop % P
        start = max(t, link_free.get((src, dst), 0.0))
        end = start + link.time(messages[hop].nbytes, messages[hop].tensors)
        link_free[(src, dst)] = end
        arrival[(direction, hop, mb)] = end
        return end

    remaining = sum(len(s) for s in schedules)
    while remaining:
        progressed = False
        for r in range(P):
            while pos[r] < len(schedules[r]):
                op = schedules[r][pos[r]]
                c, mb = op.chunk, op.microbatch
                need = (("fwd", c - 1, mb) if c > 0 else None) if op.kind == "F" else (
                    ("bwd", c, mb) if c < C - 1 else None)
                if need is not None and need not in arrival:
                    break
                work = costs.fwd_s[c] if op.kind == "F" else costs.bwd_s[c]
                host = costs.op_overhead_s + (costs.recv_overhead_s if need is not None and P > 1 else 0.0)
                start = max(free[r], arrival[need] if need is not None else 0.0)
                end = start + host + work
                free[r] = end
                if op.kind == "F" and c < C - 1:
                    done = send(r, "fwd", c, mb, end)
                elif op.kind == "B" and c > 0:
                    done = send(r, "bwd", c - 1, mb, end)
                else:
                    done = end
                if not overlap_sends:
                    free[r] = done
                spans[r].append((op, start, end))
                compute[r] += work
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: schedules[r][pos[r]] for r in range(P) if pos[r] < len(schedules[r])}
            raise RuntimeError(f"schedule deadlocks in the timing model; next ops per rank: {stuck}")
    step = max(max(free), max((e for s in spans for _, _, e in s), default=0.0))
    return Prediction(P, V, m, step, spans, compute)


def interleaved_closed_form(pp_size: int, vpp_size: int, num_microbatches: int, fwd_s: float,
                            bwd_s: float) -> float:
    """Step time of the interleaved 1F1B schedule with equal per-chunk times and free comm,
    for m a multiple of P (Megatron's default group size): ``(V*m + P - 1) * (f + b)``.

    Why: the last rank starts its first forward after the P-1 forwards of chunks 0..P-2 (one
    chunk time each); from then on it is never idle until the end (its steady 1F1B always finds
    its input ready), and after its last backward the first rank still runs the P-1 backwards of
    that microbatch's chunks on ranks P-2..0. Both ends cost (P-1)(f+b) in total, around the
    V*m*(f+b) of work each rank does. With V = 1 this is the classic (m + P - 1)(f + b).
    """
    P, V, m = pp_size, vpp_size, num_microbatches
    return (V * m + P - 1) * (fwd_s + bwd_s)
