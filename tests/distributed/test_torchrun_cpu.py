"""The documented launch path: ``torchrun --standalone --nproc-per-node 2 -m k3train train`` on CPU
(gloo, DP=2) finishes, writes metrics.jsonl and an offline wandb run holding the logged keys."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import SMALL

KEYS = ("loss", "lr", "tokens_per_s")


def _wandb_keys_found(wandb_dir) -> set[str]:
    """Keys present in the offline run: ``wandb-summary.json`` when wandb writes one, else the
    run's ``.wandb`` record log, where each history item stores its key as a plain string."""
    found = set()
    for summary in wandb_dir.glob("offline-run-*/files/wandb-summary.json"):
        found |= set(json.loads(summary.read_text())) & set(KEYS)
    for log in wandb_dir.glob("offline-run-*/run-*.wandb"):
        data = log.read_bytes()
        found |= {k for k in KEYS if k.encode() in data}
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_cpu_processes(tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", "--nproc-per-node", "2", "-m", "k3train", "train",
        "--config", "configs/k3_tiny.yaml", "--run-dir", str(tmp_path), *SMALL,
        "train.steps=3", "logging.wandb.mode=offline"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)  # the config's offline mode is what is under test
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dp 2" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and all(k in records[-1] for k in KEYS)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "exactly one (rank-0) offline wandb run"
    assert _wandb_keys_found(tmp_path / "wandb") == set(KEYS)
