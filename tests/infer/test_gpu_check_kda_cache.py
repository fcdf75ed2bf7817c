"""``scripts/gpu_check_kda_cache.py`` dry-run on CPU: the same three calls of the inference
cache (prefill from a state through ``kda_gated_state`` and through ``kda``, single-token
decode) against its fp64 token-by-token reference, where they run the torch forms in fp32:
all agree to fp32 rounding (< 1e-5), and the script's gate passes."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_kda_cache.py"


def test_dry_run_on_cpu_agrees_with_the_fp64_recurrence(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_kda_cache", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["x", "--device", "cpu", "--prefill", "70", "--steps", "3", "--json", str(out)])
    assert mod.main() == 0
    res = json.loads(out.read_text())
    for key in ("prefill_gated_o", "prefill_gated_state", "prefill_ungated_o", "prefill_ungated_state", "steps_o"):
        assert res[key] < 1e-5, (key, res[key])
    assert res["ok"] is True
