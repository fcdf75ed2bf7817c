"""``k3train model-info --fit``: the layout search (k3train/profiling/layout_fit.py).

Every layout it names fits by an independent re-plan, and no faster recompute mode would; the
predicted MFU reduces to the slice's measured rate over the datasheet peak where nothing but
compute is left (no pipeline, no collectives), and under full recompute to that times FLOPs over FLOPs plus
the layers' second forward (a third of their training FLOPs); the memory replay's shortened schedule has the full
schedule's peak; bad input is one line.
"""
from __future__ import annotations

import pytest

from k3train.cli import main
from k3train.config import load_config
from k3train.profiling.layout_fit import (PEAK, SLICE_RATE, Layout, _layout_cfg, candidate_layouts, fit_layouts,
                                          memory_microbatches, predict_mfu)
from k3train.profiling.predict import layer_flops
from k3train.profiling.memory_plan import GiB, StateLayout, _schedule_peak, plan_memory
from pipeline.schedule import check_microbatches

CFG = ["model.num_layers=8", "train.seq_len=256"]


def _tiny():
    return load_config("configs/k3_tiny.yaml", CFG)


def test_every_named_layout_fits_and_no_faster_recompute_would(world1):
    cfg = _tiny()
    fit_gib, margin = 0.2, 0.1
    fits = fit_layouts(cfg, worlds=[8], fit_gib=fit_gib, margin=margin, tasks=["pretrain"], batch_tokens=1 << 16)
    rows = fits[("pretrain", 8)]
    assert rows, "the tiny model fits 180 MiB on some layout of 8 GPUs"
    budget = fit_gib * (1 - margin) * GiB
    for f in rows:
        lay = f.layout
        assert lay.world == 8 and lay.dp % lay.ep == 0
        plans = plan_memory(_layout_cfg(cfg, Layout(**{**lay.__dict__}), f.seq_len), ops="fused", act_bytes=2,
                            dp=lay.dp, cp=lay.cp)
        heaviest = max(q.total(f.recompute, f.state.zero1, f.state) for q in plans)
        assert heaviest == pytest.approx(f.heaviest_bytes) and heaviest <= budget
        faster = ("none", "selective", "full")[:("none", "selective", "full").index(f.recompute)]
        lightest = StateLayout("bf16", "bf16", True)
        for mode in faster:     # even the lightest weight/state choice does not fit a faster mode
            assert max(q.total(mode, True, lightest) for q in plans) > budget
    mfus = [f.mfu_exposed for f in rows]
    assert mfus == sorted(mfus, reverse=True)


def test_predicted_mfu_is_the_slice_rate_where_only_compute_is_left(world1):
    cfg = _tiny()
    one = Layout(tp=1, pp=1, vpp=1, ep=1, dp=8, cp=1, micro_batch=1, microbatches=4)
    hidden, exposed, bubble = predict_mfu(cfg, one, 256, "none")
    assert hidden == pytest.approx(SLICE_RATE / PEAK, rel=1e-9)
    assert exposed == pytest.approx(hidden, rel=1e-9) and bubble == pytest.approx(0.0, abs=1e-12)
    full, _, _ = predict_mfu(cfg, one, 256, "full")
    layers, head = layer_flops(_layout_cfg(cfg, one, 256))
    total = sum(layers) + head         # the layers' forward runs again; the head is not recomputed
    assert full == pytest.approx(SLICE_RATE / PEAK * total / (total + sum(layers) / 3), rel=1e-9)
    # Expert parallelism over nodes only adds exposed time.
    ep = Layout(tp=1, pp=1, vpp=1, ep=4, dp=8, cp=1, micro_batch=1, microbatches=4)
    h, e, _ = predict_mfu(cfg, ep, 256, "none")
    assert h == pytest.approx(hidden) and e < h


@pytest.mark.parametrize("P, V", [(1, 1), (2, 1), (4, 1), (4, 2), (8, 2), (3, 3)])
def test_memory_replay_of_a_shortened_schedule_has_the_same_peak(P, V):
    """Also with what lives until the step ends (the routing records: every microbatch adds
    them, so the shortened replay starts with the left-out microbatches' records) and what a
    chunk's forward and backward hold besides (recomputed layers, gradients)."""
    chunk_bytes = {c: 1.0 + 0.37 * c for c in range(P * V)}
    records = {c: 0.05 + 0.011 * c for c in range(P * V)}
    forward = {c: 0.3 + 0.02 * c for c in range(P * V)}
    backward = {c: 0.5 - 0.03 * c for c in range(P * V)}
    for m in range(P, 12 * P, P):
        check_microbatches(P, V, m)
        short = memory_microbatches(P, V, m)
        check_microbatches(P, V, short)
        for r in range(P):
            assert _schedule_peak(P, V, short, r, chunk_bytes) == _schedule_peak(P, V, m, r, chunk_bytes)
            mine = sum(records[v * P + r] for v in range(V))     # one microbatch's, on this rank
            full = _schedule_peak(P, V, m, r, chunk_bytes, records=records, forward=forward, backward=backward)
            replayed = _schedule_peak(P, V, short, r, chunk_bytes, records=records, forward=forward,
                                      backward=backward, records_before=mine * (m - short))
            assert replayed[0] == pytest.approx(full[0], rel=1e-12) and replayed[1] == full[1]


def test_routing_records_of_every_microbatch_count_until_the_step_ends():
    """The records a rank holds at the end of its last backward: every microbatch's, whatever
    the schedule (independent count: m x the records of the rank's chunks)."""
    P, V, m = 4, 2, 16
    chunk_bytes = {c: 0.0 for c in range(P * V)}
    records = {c: 1.0 + c for c in range(P * V)}
    for r in range(P):
        mine = sum(records[v * P + r] for v in range(V))
        assert _schedule_peak(P, V, m, r, chunk_bytes, records=records)[0] == pytest.approx(m * mine)


def test_candidates_respect_the_layout_rules():
    cfg = load_config("configs/k3_full.yaml")
    lays = candidate_layouts(cfg, 512, 32768, 1 << 24, "sft")
    assert lays
    for lay in lays:
        assert lay.world == 512 and lay.dp % lay.ep == 0 and 896 % lay.ep == 0 and 96 % lay.tp == 0
        assert lay.tp * lay.cp <= 8 and lay.pp * lay.vpp <= 93 and (lay.vpp == 1 or lay.microbatches % lay.pp == 0)
    assert {lay.cp for lay in lays} == {1, 2, 4, 8}
    assert {lay.cp for lay in candidate_layouts(cfg, 512, 4096, 1 << 24, "pretrain")} == {1}


@pytest.mark.parametrize("lay, seq, state", [
    (Layout(tp=1, pp=32, vpp=1, ep=16, dp=16, cp=1, micro_batch=1, microbatches=256), 4096,
     StateLayout("fp32", "fp32", True)),
    (Layout(tp=1, pp=8, vpp=2, ep=64, dp=64, cp=4, micro_batch=1, microbatches=8), 32768,
     StateLayout("bf16", "fp32", True)),
], ids=["pretrain-64-nodes", "sft-256-nodes"])
def test_k3_layouts_named_in_the_docs_fit_an_h200(world1, lay, seq, state):
    """docs/memory.md's H200 picks (pretraining on 64 nodes, SFT at 32K on 256 with cp 4): the
    heaviest rank under 141 GiB less the 10% margin, by the planner directly over the step's
    whole schedule (not through the search's shortened replay)."""
    cfg = load_config("configs/k3_full.yaml")
    plans = plan_memory(_layout_cfg(cfg, lay, seq), ops="fused", act_bytes=2, dp=lay.dp)
    assert max(q.total("full", True, state) for q in plans) / GiB <= 141 * 0.9


def test_fit_cli_prints_predicted_layouts_and_refuses_bad_input(capsys):
    assert main(["model-info", "--config", "configs/k3_tiny.yaml", *CFG, "--fit", "0.2", "--world", "8",
                 "--task", "pretrain", "--batch-tokens", "65536", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "pretrain (seq_len 4096), 1 nodes x 8 GPUs" in out
    assert main(["model-info", "--config", "configs/k3_tiny.yaml", "--fit", "0.05", "--nodes", "two"]) == 2
    err = capsys.readouterr().err
    assert "--nodes takes comma-separated node counts" in err and len(err.strip().splitlines()) == 1
