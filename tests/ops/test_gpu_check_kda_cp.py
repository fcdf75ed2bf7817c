"""``scripts/gpu_check_kda_cp.py`` dry-run on CPU: the one-device fold (three chunks) and the
whole-sequence call both run the torch form in fp32, and both agree with the fp64 reference to
fp32 rounding (< 1e-5) in the output and every input gradient; the script's gate passes."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_kda_cp.py"


def test_dry_run_on_cpu_agrees_with_fp64(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check_kda_cp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    argv = ["--device", "cpu", "--seq-len", "96", "--chunks", "3", "--heads", "2", "--dim", "16", "--json", str(out)]
    assert mod.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["backend"] == "torch" and res["pass"] is True
    for run in ("whole", "folded"):
        for name in mod.NAMES:
            assert res[run][name] < 1e-5, (run, name, res[run][name])
