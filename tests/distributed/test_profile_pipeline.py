"""`torchrun ... -m k3train profile-pipeline` as a user runs it (2 gloo ranks)."""
import pytest
import json
import os
import subprocess
import sys

from tests.helpers import SMALL


@pytest.mark.slow
def test_profile_pipeline_command(tmp_path):
    out = tmp_path / "pipeline.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "k3train", "profile-pipeline", "--config", "configs/k3_tiny.yaml", "--json", str(out),
           *SMALL, "model.num_layers=8", "parallel.pp=2", "parallel.vpp=2", "train.microbatches=4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    for transport in ("naive", "cached"):
        assert report[transport]["measured_bytes"] == report[transport]["predicted_bytes"] > 0
    assert report["cached"]["measured_bytes"] < report["naive"]["measured_bytes"]
    assert report["naive_over_cached"] > 2
    assert report["bubble_theory"] == (2 - 1) / (2 * 4)
    assert 0 <= report["bubble_fraction"] < 1
    assert all(v > 0 for v in report["cached"]["peak_cache_bytes"].values())
    trace = json.loads((tmp_path / "pipeline_trace.json").read_text())
    assert len(trace["traceEvents"]) > 0
    assert (tmp_path / "pipeline_gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "naive" in done.stdout and "bubble: measured" in done.stdout
