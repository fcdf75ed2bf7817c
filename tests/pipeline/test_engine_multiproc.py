"""The engine on gloo ranks reproduces the single-process loss and every parameter gradient.

Tolerance: fp32, rtol 1e-5 / atol 1e-6 (only summation order differs from the reference).
Several configurations share one spawned job to keep start-up cost low (~5 s per spawn).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from pipeline import CommRecorder, PipelineEngine, PipelineLayout
from tests.multiproc import run_multiprocess
from tests.pipeline.toy_model import build_chunks, make_batch, reference

RTOL, ATOL = 1e-5, 1e-6

# (P, V, m, layers, first_chunk_layers, last_chunk_layers)
GRIDS = {
    2: [(2, 2, 4, 8, None, None), (2, 3, 6, 6, None, None), (2, 1, 3, 4, None, None),
        (2, 2, 4, 10, 3, 1)],                                   # uneven split: 3,3,3,1 layers
    3: [(3, 2, 6, 12, None, None)],
    4: [(4, 2, 8, 8, None, None)],
}
VARIANTS = [("cached", True), ("naive", True), ("cached", False)]   # (transport, attnres)


def _run_config(group, P, V, m, layers, first, last, transport, attnres, microbatches=None,
                dp_group=None, ref_batch=None):
    """Two train steps (handshake step, then steady shapes); returns the gathered recorder."""
    layout = PipelineLayout(layers, P, V, first, last)
    chunks, produced = build_chunks(layout, attnres)
    microbatches = microbatches or make_batch(m)
    ref_loss, ref_grads = reference(chunks, ref_batch or microbatches)
    rank = dist.get_rank(group)
    local = {c: chunks[c] for c in layout.chunks_of_rank(rank)}
    rec = CommRecorder()
    engine = PipelineEngine(local_chunks=local, num_chunks=layout.num_chunks, produced_blocks=produced,
                            pp_group=group, transport=transport, dp_group=dp_group, recorder=rec)
    what = f"P{P} V{V} m{m} L{layers} {transport} attnres={attnres}"
    for step in range(2):
        for ch in local.values():
            ch.zero_grad(set_to_none=True)
        loss = engine.train_step(microbatches)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=f"{what} step {step} loss")
        for c, ch in local.items():
            for n, p in ch.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[c][n], rtol=RTOL, atol=ATOL,
                                           msg=lambda s: f"{what} step {step} chunk {c} {n}: {s}")
    assert loss.item() == pytest.approx(engine.eval_step(microbatches).item(), rel=1e-6)
    # eval_step opened a new recorder step; report on the last training step.
    rec.comm = [r for r in rec.comm if r.step == 1]
    rec.compute = [s for s in rec.compute if s.step == 1]
    rec.info = {**rec.info, "num_microbatches": len(microbatches)}
    rec.gather(group)
    return rec


def _check_bytes(rec, what):
    table = rec.bytes_table()
    assert table["measured_fwd"] == table["predicted_fwd"], what
    assert table["measured_bwd"] == table["predicted_fwd"], what     # gradients mirror the forward
    for row in table["rows"]:
        assert row["measured_fwd"] == row["predicted_fwd"], (what, row)
    return table


def _grid_job(rank, world_size, out_dir):
    """Every grid in one 4-rank job: P=2 and P=3 run on subgroups while the other ranks wait."""
    groups = {P: dist.new_group(list(range(P))) for P in (2, 3)}
    groups[4] = dist.group.WORLD
    results = {}
    for P in (2, 3, 4):
        if rank < P:
            _grid(groups[P], P, rank, out_dir, results)
        dist.barrier()
    _pp_dp(rank)


def _grid(group, P, rank, out_dir, results):
    for P_, V, m, layers, first, last in GRIDS[P]:
        for transport, attnres in VARIANTS:
            what = f"P{P} V{V} m{m} L{layers} {transport} attnres={attnres}"
            rec = _run_config(group, P, V, m, layers, first, last, transport, attnres)
            if rank != 0:
                continue
            results[what] = _check_bytes(rec, what)["measured_fwd"]
            if transport == "cached" and attnres and V > 1:
                assert all(v > 0 for v in rec.bytes_table()["peak_cache_bytes"].values()), what
            if (transport, attnres) == ("cached", True) and (P, V, m, layers) == (2, 2, 4, 8):
                n = rec.write_chrome_trace(os.path.join(out_dir, "trace.json"))
                rec.write_gantt_png(os.path.join(out_dir, "gantt.png"))
                C = P * V
                with open(os.path.join(out_dir, "counts.json"), "w") as f:
                    json.dump({"events": n, "expected": 2 * m * C + 4 * m * (C - 1),
                               "table": rec.format_bytes_table(), "bubble": rec.bubble_fraction()}, f)
        if rank == 0 and V > 1:
            base = f"P{P} V{V} m{m} L{layers}"
            assert results[f"{base} cached attnres=True"] < results[f"{base} naive attnres=True"], results


def _pp_dp(rank):
    """PP=2 x DP=2: groups from megatron-core parallel_state on gloo."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp, dp = parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_data_parallel_group()
    m = 4
    batch = make_batch(2 * m, seed=7)
    d = dist.get_rank(dp)
    for transport in ("cached", "naive"):
        _run_config(pp, 2, 2, m, 8, None, None, transport, True, microbatches=batch[d * m:(d + 1) * m],
                    dp_group=dp, ref_batch=batch)


@pytest.mark.slow
def test_engine_matches_single_process(tmp_path):
    """P in {2, 3, 4} grids x {cached, naive, standard residual}, then PP=2 x DP=2."""
    run_multiprocess(_grid_job, 4, str(tmp_path))
    counts = json.loads((tmp_path / "counts.json").read_text())
    assert counts["events"] == counts["expected"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == counts["expected"]
    assert (tmp_path / "gantt.png").stat().st_size > 1000
    assert 0.0 <= counts["bubble"]["measured"] < 1.0
