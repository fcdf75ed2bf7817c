"""Records of every p2p op and compute span, gathered to rank 0; bytes table and bubble fraction."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from pipeline.trace import write_chrome_trace, write_gantt_png
from pipeline.transport import TransportPlan, cached_volume_exact, closed_form_volume, predicted_bytes


@dataclass
class CommRecord:
    """One message (a list of tensors) sent or received by ``rank``; times from perf_counter (s).

    chunk: the local chunk the message belongs to (sender chunk for sends, consumer for recvs).
    end: for receives, when the data was waited for; for sends, when completion was observed
    (sends are only waited at the end of the step, see p2p.py).
    """

    step: int
    rank: int
    kind: str                 # "send" | "recv"
    direction: str            # "fwd" | "bwd" | "meta"
    hop: int
    chunk: int
    microbatch: int
    peer: int
    tensor_ids: list[str]
    nbytes: int
    start: float
    end: float


@dataclass
class ComputeSpan:
    step: int
    rank: int
    kind: str                 # "F" | "B"
    chunk: int
    microbatch: int
    start: float
    end: float


class SpanTimer:
    """Start and end times of a step's compute ops, in seconds on the host's perf_counter clock.

    On CPU the host clock is the compute clock. On CUDA the host only queues kernels, so host
    times would show when the work was queued, not when it ran (a bubble measured that way is
    near zero); there each op is bracketed by CUDA events on the current stream, converted at
    :meth:`spans` (one sync at the end of the step) to ``host_t0 + device time since t0``.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self._origin = self.mark() if self.cuda else None
        self._done: list[tuple[str, int, int, object, object]] = []

    def mark(self):
        """A point in time: ``perf_counter()`` on CPU, a recorded CUDA event on GPU."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def add(self, kind: str, chunk: int, microbatch: int, start) -> None:
        """Close the span opened by ``start = mark()``."""
        self._done.append((kind, chunk, microbatch, start, self.mark()))

    def spans(self) -> list[tuple[str, int, int, float, float]]:
        """``(kind, chunk, microbatch, start_s, end_s)`` per op, in the order they were stopped."""
        if not self.cuda:
            return [(k, c, mb, a, b) for k, c, mb, a, b in self._done]
        if self._done:
            self._done[-1][4].synchronize()

        def at(ev) -> float:
            return self.t0 + self._origin.elapsed_time(ev) / 1e3

        return [(k, c, mb, at(a), at(b)) for k, c, mb, a, b in self._done]


@dataclass
class CommRecorder:
    """Per-rank collector; the engine fills it, :meth:`gather` merges all ranks onto rank 0.

    info (set by the engine each step): ``plan`` (TransportPlan), ``pp_size``, ``vpp_size``,
    ``num_microbatches``, ``block_bytes`` (one [B, T, D] tensor), ``has_hidden`` {hop: bool},
    ``peak_cache_bytes`` {rank: int}.
    """

    rank: int = 0
    step: int = -1
    comm: list[CommRecord] = field(default_factory=list)
    compute: list[ComputeSpan] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def new_step(self) -> int:
        self.step += 1
        return self.step

    def add_comm(self, **kw) -> None:
        self.comm.append(CommRecord(step=self.step, rank=self.rank, **kw))

    def add_compute(self, kind: str, chunk: int, microbatch: int, start: float, end: float) -> None:
        self.compute.append(ComputeSpan(self.step, self.rank, kind, chunk, microbatch, start, end))

    def reset(self) -> None:
        self.comm, self.compute, self.step = [], [], -1

    def gather(self, group=None, dst: int = 0) -> None:
        """Merge every rank's records onto group rank ``dst`` (others keep their own)."""
        if group is None and not dist.is_initialized():
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        mine = (self.comm, self.compute, self.info)
        out = [None] * len(ranks) if dist.get_rank() == ranks[dst] else None
        dist.gather_object(mine, out, dst=ranks[dst], group=group)
        if out is None:
            return
        self.comm, self.compute = [], []
        has_hidden, peak = {}, {}
        for comm, compute, info in out:
            self.comm += comm
            self.compute += compute
            has_hidden.update(info.get("has_hidden", {}))
            peak.update(info.get("peak_cache_bytes", {}))
        self.info = {**out[dst][2], "has_hidden": has_hidden, "peak_cache_bytes": peak}

    # ---- reports ------------------------------------------------------------------------------
    def _last(self, items):
        step = max((x.step for x in items), default=-1)
        return [x for x in items if x.step == step]

    def measured_bytes(self) -> dict:
        """Bytes sent in the last step, per hop and direction (meta handshake counted apart)."""
        per_hop: dict[int, dict[str, int]] = {}
        meta = 0
        for r in self._last(self.comm):
            if r.kind != "send":
                continue
            if r.direction == "meta":
                meta += r.nbytes
                continue
            per_hop.setdefault(r.hop, {"fwd": 0, "bwd": 0})[r.direction] += r.nbytes
        return {"per_hop": dict(sorted(per_hop.items())), "meta": meta,
                "total_fwd": sum(h["fwd"] for h in per_hop.values()),
                "total_bwd": sum(h["bwd"] for h in per_hop.values())}

    def predicted(self) -> dict:
        """The engine's own prediction from the static plan (see transport.predicted_bytes)."""
        plan: TransportPlan = self.info["plan"]
        hh = self.info["has_hidden"]
        has_hidden = [hh.get(c, True) for c in range(plan.num_chunks - 1)]
        d = self.info["block_bytes"]
        return predicted_bytes(plan, d, d, self.info["num_microbatches"], has_hidden)

    def bytes_table(self) -> dict:
        """Measured vs predicted per hop, totals, and the closed forms of docs/attnres.md#the-byte-count
        (forward, blocks).

        Closed forms assume every chunk produces the same number of blocks Np; ``blocks_per_chunk``
        is the plan's mean. The hidden tensors are reported separately (``hidden_bytes``).
        """
        meas, pred = self.measured_bytes(), self.predicted()
        plan: TransportPlan = self.info["plan"]
        P, V, m = self.info["pp_size"], self.info["vpp_size"], self.info["num_microbatches"]
        d = self.info["block_bytes"]
        np_ = sum(len(p) for p in plan.produced) / plan.num_chunks
        rows = []
        for h in pred["per_hop"]:
            got = meas["per_hop"].get(h["hop"], {"fwd": 0, "bwd": 0})
            rows.append({"hop": h["hop"], "blocks": h["blocks"], "measured_fwd": got["fwd"],
                         "measured_bwd": got["bwd"], "predicted_fwd": h["block_bytes"] + h["hidden_bytes"]})
        return {
            "transport": plan.transport, "rows": rows,
            "measured_fwd": meas["total_fwd"], "measured_bwd": meas["total_bwd"],
            "predicted_fwd": pred["total_fwd"], "predicted_block_bytes": pred["block_bytes"],
            "hidden_bytes": pred["hidden_bytes"], "meta_bytes": meas["meta"],
            "closed_form_block_bytes": m * closed_form_volume(plan.transport, P, V, 1, d) * np_,
            "cached_exact_block_bytes": m * cached_volume_exact(P, V, 1, d) * np_,
            "peak_cache_bytes": self.info.get("peak_cache_bytes", {}),
        }

    def format_bytes_table(self) -> str:
        t = self.bytes_table()
        lines = [f"transport={t['transport']}", "hop  blocks            measured_fwd  predicted_fwd  measured_bwd"]
        for r in t["rows"]:
            lines.append(f"{r['hop']:>3}  {str(r['blocks']):<16}  {r['measured_fwd']:>12}  "
                         f"{r['predicted_fwd']:>13}  {r['measured_bwd']:>12}")
        lines.append(f"total fwd measured {t['measured_fwd']} predicted {t['predicted_fwd']} "
                     f"(blocks {t['predicted_block_bytes']}, hidden {t['hidden_bytes']}); "
                     f"closed form blocks {t['closed_form_block_bytes']:.0f}")
        return "\n".join(lines)

    def bubble_fraction(self) -> dict:
        """Idle compute time / (step time * P) of the last step, next to (P-1)/(V*m)."""
        spans = self._last(self.compute)
        P, V, m = self.info["pp_size"], self.info["vpp_size"], self.info["num_microbatches"]
        if not spans:
            return {"measured": float("nan"), "theory": (P - 1) / (V * m)}
        t0 = min(s.start for s in spans)
        step_time = max(s.end for s in spans) - t0
        busy = sum(s.end - s.start for s in spans)
        idle = step_time * P - busy
        return {"measured": idle / (step_time * P), "theory": (P - 1) / (V * m), "step_time_s": step_time}

    def to_dict(self) -> dict:
        return {"comm": [asdict(r) for r in self.comm], "compute": [asdict(s) for s in self.compute]}

    def write_chrome_trace(self, path) -> int:
        return write_chrome_trace(self, path)

    def write_gantt_png(self, path) -> None:
        write_gantt_png(self, path)
