"""Issue 44 item 10 (sweep part, ``--jobs N``): a sweep training its variants in N subprocesses
that gets SIGTERM/SIGINT passes the signal on to the running variants (each saves and stops),
starts no further variant and exits EXIT_SWEEP_STOPPED (3), not 0 and not -15."""
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k3train.sweep.runner import EXIT_SWEEP_STOPPED
from tests.cli_runs import cli_env, wait_for
from tests.helpers import SMALL

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a sweep process and two training subprocesses (~100 s on 2 shared cores)
def test_a_signalled_parallel_sweep_exits_3_and_its_variants_saved(tmp_path):
    """SIGTERM (SIGINT takes the same handler in ``_train_in_subprocesses``)."""
    sig = signal.SIGTERM
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump({"name": "unit", "base": str(ROOT / "configs/k3_tiny.yaml"),
                                    "overrides": [*SMALL, "train.steps=100000", "train.log_interval=1"],
                                    "grid": {"optim.lr": [1e-3, 2e-3, 3e-3]}}))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "k3train", "sweep", str(path), "--out", str(out), "--jobs", "2"],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = [out / "lr-0.001" / "metrics.jsonl", out / "lr-0.002" / "metrics.jsonl"]
    try:
        assert wait_for(lambda: all(m.exists() and m.read_text().count("\n") >= 1 for m in running), timeout=240)
    finally:
        proc.send_signal(sig)
        log, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_SWEEP_STOPPED == 3, log
    for name in ("lr-0.001", "lr-0.002"):  # each running variant saved a checkpoint to resume from
        assert (out / name / "checkpoints" / "latest").is_file(), (name, log)
        assert not (out / name / "DONE").exists()
    assert not (out / "lr-0.003").exists() and not (out / "logs" / "lr-0.003.log").exists(), log
    assert "Traceback" not in log and "3 variant(s) left" in log, log
