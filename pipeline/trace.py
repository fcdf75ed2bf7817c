"""Timeline exports of a gathered CommRecorder: Chrome trace JSON (Perfetto) and a Gantt PNG."""
from __future__ import annotations

import json

_THREADS = {"compute": 0, "send": 1, "recv": 2}


def _last_step(rec):
    step = max([s.step for s in rec.compute] + [c.step for c in rec.comm], default=-1)
    return [s for s in rec.compute if s.step == step], [c for c in rec.comm if c.step == step]


def write_chrome_trace(rec, path) -> int:
    """Write the last step as Chrome trace events; returns the number of duration ("X") events.

    One process per rank, threads ``compute`` / ``send`` / ``recv``; times in microseconds
    from the step's first event. Open the file in https://ui.perfetto.dev.
    """
    spans, comms = _last_step(rec)
    t0 = min([s.start for s in spans] + [c.start for c in comms], default=0.0)
    events = []
    for rank in sorted({s.rank for s in spans} | {c.rank for c in comms}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"pp rank {rank}"}})
        for name, tid in _THREADS.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    n = 0
    for s in spans:
        events.append({"name": f"{s.kind} c{s.chunk} mb{s.microbatch}", "cat": s.kind, "ph": "X",
                       "pid": s.rank, "tid": 0, "ts": (s.start - t0) * 1e6,
                       "dur": max(s.end - s.start, 0.0) * 1e6,
                       "args": {"chunk": s.chunk, "microbatch": s.microbatch}})
        n += 1
    for c in comms:
        events.append({"name": f"{c.kind} {c.direction} hop{c.hop} mb{c.microbatch}", "cat": c.direction,
                       "ph": "X", "pid": c.rank, "tid": _THREADS[c.kind], "ts": (c.start - t0) * 1e6,
                       "dur": max(c.end - c.start, 0.0) * 1e6,
                       "args": {"peer": c.peer, "bytes": c.nbytes, "tensors": c.tensor_ids, "chunk": c.chunk}})
        n += 1
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return n


def gantt_title(rec, num_ranks: int) -> str:
    """The Gantt chart's title: the layout and the step it shows (chunk.microbatch on each bar)."""
    info = getattr(rec, "info", None) or {}
    layout = ", ".join(f"{k} {info[v]}" for k, v in (("P", "pp_size"), ("V", "vpp_size"),
                                                      ("m", "num_microbatches")) if v in info)
    return (f"pipeline step timeline, {num_ranks} rank{'s' if num_ranks != 1 else ''}"
            + (f" ({layout})" if layout else "") + ": compute rows labelled chunk.microbatch, p2p rows below")


def write_gantt_png(rec, path) -> None:
    """Gantt chart of the last step: per rank a compute row (F blue, B orange) and a comm row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans, comms = _last_step(rec)
    t0 = min([s.start for s in spans] + [c.start for c in comms], default=0.0)
    ranks = sorted({s.rank for s in spans} | {c.rank for c in comms})
    fig, ax = plt.subplots(figsize=(12, 1 + 0.8 * len(ranks)))
    colors = {"F": "tab:blue", "B": "tab:orange", "send": "tab:green", "recv": "tab:gray"}
    for i, rank in enumerate(ranks):
        y = 2 * (len(ranks) - 1 - i)
        for s in (s for s in spans if s.rank == rank):
            ax.broken_barh([((s.start - t0) * 1e3, (s.end - s.start) * 1e3)], (y + 1, 0.8),
                           color=colors[s.kind])
            ax.text((s.start - t0) * 1e3, y + 1.3, f"{s.chunk}.{s.microbatch}", fontsize=6)
        for c in (c for c in comms if c.rank == rank and c.direction != "meta"):
            ax.broken_barh([((c.start - t0) * 1e3, max(c.end - c.start, 1e-6) * 1e3)],
                           (y + (0.05 if c.kind == "send" else 0.45), 0.35), color=colors[c.kind], alpha=0.6)
    ax.set_yticks([2 * (len(ranks) - 1 - i) + 1 for i in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlabel("ms since step start")
    ax.set_title(gantt_title(rec, len(ranks)), fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    # Outside the axes, right of the last bar: inside it covered the late ranks' ops.
    ax.legend(handles, ["forward", "backward", "send", "recv"], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
