"""``scripts/gpu_check_te.py``'s resume step on CPU: a run directory holding only the middle
checkpoint of a finished run (``resume_from``, hard links), resumed through the same ``k3train
train`` call the script makes, trains the next step on the same weights and batch, so in fp32 on
CPU its loss equals the original run's loss at that step (what the script compares across
backends on a GPU, within its stated tolerances)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.helpers import SMALL

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_te.py"


@pytest.mark.slow
def test_resume_from_the_middle_checkpoint_repeats_the_next_step(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check_te", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    common = [*SMALL, "train.device=cpu", "precision.recipe=fp32", "train.steps=6", "train.log_interval=1",
              "train.eval_interval=60", "checkpoint.interval=3", "checkpoint.keep_last=4"]
    first = mod.train("configs/k3_tiny.yaml", tmp_path / "a", common)
    assert first["rc"] == 0, first.get("error")
    summary = mod.summarise(first)
    assert sorted(summary["losses"]) == [1, 2, 3, 4, 5, 6] and summary["tokens_per_s"] > 0
    mod.resume_from(tmp_path / "a", 3, tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["latest", "step_00000003"]
    again = mod.train("configs/k3_tiny.yaml", tmp_path / "b", [*common, "train.steps=4"], resume=True)
    assert again["rc"] == 0, again.get("error")
    assert [r["step"] for r in again["records"]] == [4]
    assert again["records"][0]["loss"] == summary["losses"][4]
