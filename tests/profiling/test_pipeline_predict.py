"""predict-pipeline's inputs: per-layer FLOPs, chunk costs, messages, the json path."""
import json

import pytest
import torch

from k3train.config import load_config
from k3train.errors import UsageError
from k3train.model.flops import flops_per_token
from k3train.model.model import produced_blocks
from k3train.profiling.predict import (VARIANTS, chunk_costs, flop_scaled_layer_costs, layer_flops,
                                      layout_messages, predict_table, run_predict, seconds_per_flop,
                                      variant_config)
from pipeline import build_plan, predicted_bytes
from pipeline.timing_model import LinkCost

TINY = ["train.seq_len=32", "train.micro_batch_size=2", "logging.wandb.mode=disabled"]


@pytest.mark.parametrize("config", ["configs/k3_tiny.yaml", "configs/k3_mini.yaml", "configs/k3_full.yaml"])
@pytest.mark.parametrize("attnres", [True, False])
def test_layer_flops_sum_to_the_model(config, attnres):
    cfg = load_config(config, [f"model.attnres.enabled={str(attnres).lower()}"])
    per_layer, head = layer_flops(cfg)
    assert len(per_layer) == cfg.model.num_layers
    assert sum(per_layer) + head == pytest.approx(flops_per_token(cfg), rel=1e-12)


def test_flop_scaling_and_chunk_sums():
    cfg = load_config("configs/k3_tiny.yaml", TINY)
    costs = flop_scaled_layer_costs(cfg, 1e-9)
    assert seconds_per_flop(cfg, costs) == pytest.approx(1e-9)
    for f, b in zip(costs["fwd_s"], costs["bwd_s"]):
        assert b == pytest.approx(2 * f)
    oc = chunk_costs(costs, 8, 3)                              # 3 + 3 + 2 layers
    assert oc.fwd_s[0] == pytest.approx(sum(costs["fwd_s"][:3]))
    assert oc.bwd_s[2] == pytest.approx(sum(costs["bwd_s"][6:]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_messages_are_the_engines_prediction(variant):
    cfg = variant_config(load_config("configs/k3_tiny.yaml", TINY), variant)
    msgs = layout_messages(cfg, 2, 2)
    d = 2 * 32 * cfg.model.hidden_size * 4
    ranges = [(0, 2), (2, 4), (4, 6), (6, 8)]
    plan = build_plan(produced_blocks(cfg, ranges), 2, VARIANTS[variant][1])
    assert sum(m.nbytes for m in msgs) == predicted_bytes(plan, d, d, 1)["total_fwd"]


def test_predict_from_json(tmp_path, capsys):
    cfg = load_config("configs/k3_tiny.yaml", TINY)
    std = flop_scaled_layer_costs(variant_config(cfg, "standard"), 1e-9)
    att = flop_scaled_layer_costs(variant_config(cfg, "attnres_cached"), 1e-9)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"standard": std, "attnres_cached": att, "attnres_naive": att}))
    report = run_predict(cfg, tmp_path / "out.json", costs_path=str(path), k3_config="configs/k3_full.yaml")
    rows = {(r["P"], r["V"], r["m"]): r for r in report["table"]}
    # 8 layers: P*V <= 8 only; P=4 V=2 needs m a multiple of 4 (8, 16, 32 all are).
    assert (2, 4, 8) in rows and (4, 2, 8) in rows and (4, 4, 8) not in rows and (16, 1, 8) not in rows
    # Same compute in both AttnRes variants: naive differs only by its larger messages.
    for r in rows.values():
        assert r["attnres_naive_ms"] >= r["attnres_cached_ms"] - 1e-9
    assert all(r["P"] == 16 for r in report["k3_table"])
    assert "PREDICTED" in capsys.readouterr().out
    # The rows equal a direct call (the json only carried the costs).
    again = predict_table(cfg, {"standard": std, "attnres_cached": att, "attnres_naive": att},
                          LinkCost(latency_s=32e-6, bandwidth_Bps=315e9))
    assert again == report["table"]


def test_bad_costs_json(tmp_path):
    cfg = load_config("configs/k3_tiny.yaml", TINY)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"standard": {"fwd_s": [1.0], "bwd_s": [1.0]}}))
    with pytest.raises(UsageError, match="needs fwd_s and bwd_s of 8 layers"):
        run_predict(cfg, tmp_path / "out.json", costs_path=str(path))


def test_cli_predict_with_costs_and_link(tmp_path):
    from k3train.cli import main

    cfg = load_config("configs/k3_tiny.yaml", TINY)
    costs = {v: flop_scaled_layer_costs(variant_config(cfg, v), 1e-9) for v in VARIANTS}
    (tmp_path / "costs.json").write_text(json.dumps({"layer_costs": costs}))
    out = tmp_path / "pred.json"
    assert main(["predict-pipeline", "--config", "configs/k3_tiny.yaml", "--json", str(out),
                 "--costs", str(tmp_path / "costs.json"), "--k3-config", "", "--link-latency-us", "5",
                 "--link-gbps", "2", *TINY]) == 0
    report = json.loads(out.read_text())
    assert report["link"] == pytest.approx({"latency_s": 5e-6, "bandwidth_Bps": 2e9}) and "k3_table" not in report
    slow = predict_table(cfg, costs, LinkCost(latency_s=report["link"]["latency_s"], bandwidth_Bps=2e9))
    assert report["table"] == json.loads(json.dumps(slow))


def test_chunk_timing_compiles_ahead_without_recording_the_pass(monkeypatch):
    """On a Triton device the chunk timing compiles its kernels in a throwaway engine step first
    (run here for real on CPU, as the pass does minus the launches): the recorder sees only the
    warm-up and timed steps, every chunk's forward and backward once per microbatch."""
    import pipeline
    from k3train.ops import kernels
    from k3train.ops import triton_compile
    from k3train.profiling.predict import measure_chunk_times

    ran, recorders = [], []

    class Recorder(pipeline.CommRecorder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            recorders.append(self)

    monkeypatch.setattr(pipeline, "CommRecorder", Recorder)
    monkeypatch.setattr(kernels, "uses_triton", lambda device: True)
    monkeypatch.setattr(triton_compile, "compile_ahead", lambda fn, label="": ran.append(fn()) or {"kernels": 0})
    cfg = load_config("configs/k3_tiny.yaml", [*TINY, "train.microbatches=2", "train.device=cpu"])
    fwd, bwd = measure_chunk_times(cfg, 2, steps=1, warmup=1)
    assert len(ran) == 1 and len(fwd) == len(bwd) == 2 and min(fwd + bwd) > 0
    (rec,) = recorders
    for kind in "FB":
        spans = [s for s in rec.compute if s.kind == kind]
        assert sorted((s.step, s.chunk) for s in spans) == sorted((st, c) for st in (0, 1) for c in (0, 1) for _ in range(2))
    # busy=: one more, profiled step; its spans summed per microbatch, no CUDA kernels on CPU.
    busy = {}
    measure_chunk_times(cfg, 2, steps=1, warmup=1, busy=busy)
    extra = [s for s in recorders[-1].compute if s.step == 2]
    assert len(extra) == 2 * 2 * 2  # forward and backward of 2 chunks x 2 microbatches
    assert busy["span_s"] == pytest.approx(sum(s.end - s.start for s in extra) / 2, rel=1e-12)
    assert busy["kernel_s"] is None
    names = {r["name"] for r in busy["host_ops"]}
    assert any(n.startswith("aten::") for n in names)
    assert [r["self_ms"] for r in busy["host_ops"]] == sorted((r["self_ms"] for r in busy["host_ops"]), reverse=True)


def test_host_ops_agrees_with_the_profilers_own_table():
    """host_ops against torch's key_averages() on a profile of known calls: 3 matmuls and 2 adds
    per 'microbatch', m = 2."""
    from torch.profiler import ProfilerActivity, profile

    from k3train.profiling.predict import host_ops

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            for _ in range(3):
                torch.mm(a, a)
            for _ in range(2):
                torch.add(a, a)
    rows = {r["name"]: r for r in host_ops(prof.events(), m=2, top=100)}
    want = {e.key: e for e in prof.key_averages()}
    assert rows["aten::mm"]["calls"] == 3 and rows["aten::add"]["calls"] == 2
    for name in ("aten::mm", "aten::add"):
        assert rows[name]["self_ms"] == pytest.approx(want[name].self_cpu_time_total / 1e3 / 2, rel=1e-9)


def test_host_excess_subtracts_by_name_and_counts_missing_names_as_zero():
    from k3train.profiling.predict import host_excess

    base = [{"name": "mm", "self_ms": 5.0, "calls": 10}, {"name": "gone", "self_ms": 1.0, "calls": 2}]
    other = [{"name": "mm", "self_ms": 6.5, "calls": 12}, {"name": "attnres", "self_ms": 4.0, "calls": 32}]
    rows = host_excess(base, other)
    assert [r["name"] for r in rows] == ["attnres", "mm", "gone"]
    assert rows[0] == {"name": "attnres", "self_ms": 4.0, "calls": 32}
    assert rows[1]["self_ms"] == pytest.approx(1.5) and rows[1]["calls"] == 2
    assert rows[2] == {"name": "gone", "self_ms": -1.0, "calls": -2}


@pytest.mark.parametrize("attnres", [True, False])
def test_split_by_flops_keeps_chunk_sums_and_follows_layer_flops(attnres):
    from k3train.profiling.predict import split_by_flops

    cfg = load_config("configs/k3_tiny.yaml", [*TINY, f"model.attnres.enabled={str(attnres).lower()}"])
    L = cfg.model.num_layers
    per_layer, head = layer_flops(cfg)
    per_layer[-1] += head
    # one chunk per layer: the measured times come back as they are
    times = {"fwd_s": [0.1 * (i + 1) for i in range(L)], "bwd_s": [0.3 * (i + 1) for i in range(L)]}
    assert split_by_flops(cfg, times) == times
    # two chunks of L/2 layers: sums kept, shares by FLOPs (a hand loop over the layer FLOPs)
    chunks = {"fwd_s": [2.0, 5.0], "bwd_s": [4.0, 11.0]}
    out = split_by_flops(cfg, chunks)
    half = L // 2
    for key in chunks:
        for c, layers in enumerate((range(half), range(half, L))):
            assert sum(out[key][i] for i in layers) == pytest.approx(chunks[key][c], rel=1e-12)
            total = sum(per_layer[i] for i in layers)
            for i in layers:
                assert out[key][i] == pytest.approx(chunks[key][c] * per_layer[i] / total, rel=1e-12)
    assert out["fwd_s"][L - 1] / out["fwd_s"][half] == pytest.approx(per_layer[L - 1] / per_layer[half])


def test_measure_layer_costs_times_chunks_of_k_layers(monkeypatch):
    import k3train.profiling.predict as pp

    calls = []

    def fake(cfg, num_chunks, steps=3, busy=None):
        calls.append((cfg.model.attnres.enabled, num_chunks))
        return [1.0 + c for c in range(num_chunks)], [2.0 + c for c in range(num_chunks)]

    monkeypatch.setattr(pp, "measure_chunk_times", fake)
    cfg = load_config("configs/k3_tiny.yaml", TINY)
    L = cfg.model.num_layers
    costs = pp.measure_layer_costs(cfg, steps=1, progress=lambda msg: None, layers_per_chunk=L // 2)
    assert calls == [(False, 2), (True, 2)]
    for variant in VARIANTS:
        assert len(costs[variant]["fwd_s"]) == L
        assert sum(costs[variant]["fwd_s"][:L // 2]) == pytest.approx(1.0)
        assert sum(costs[variant]["bwd_s"][L // 2:]) == pytest.approx(3.0)
    with pytest.raises(UsageError, match="must divide model.num_layers"):
        pp.measure_layer_costs(cfg, layers_per_chunk=3)


def test_costs_json_with_layers_per_chunk_is_refused(tmp_path):
    cfg = load_config("configs/k3_tiny.yaml", TINY)
    with pytest.raises(UsageError, match="nothing is measured"):
        run_predict(cfg, tmp_path / "r.json", costs_path=str(tmp_path / "c.json"), layers_per_chunk=2)
