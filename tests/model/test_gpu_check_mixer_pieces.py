"""``scripts/gpu_check_mixer_pieces.py`` dry-run on CPU: each mixer (KDA, MLA) in four pieces,
chained as recompute chains them (documents crossing the piece boundaries and one inside a
halo), and the whole layer both run the torch forms in fp32, and both agree with the fp64
whole layer to fp32 rounding (< 1e-5) in the output, the input's gradient and every
parameter's; the script's gate passes."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_mixer_pieces.py"


def test_dry_run_on_cpu_agrees_with_fp64(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check_mixer_pieces", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    assert mod.main(["--device", "cpu", "--seq-len", "256", "--pieces", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["pass"] is True and res["documents"] == [0, 64, 127, 256, 512]
    params = {"kda": 14, "mla": 8}
    for kind in ("kda", "mla"):
        for run in ("whole", "pieces"):
            errs = res[kind][run]
            assert len(errs) == 2 + params[kind], (kind, sorted(errs))   # out, dx and every parameter
            for name, err in errs.items():
                assert err < 1e-5, (kind, run, name, err)
