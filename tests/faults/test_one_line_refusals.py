"""Issue 44 item 7 (config part): a config file that is not text is one line, and a layout error
under torchrun is said once (rank 0), not once per worker, with a non-zero exit. Each case runs
through the CLI (``k3train.cli.main``) and must leave the run directory unwritten."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3train.cli import main as cli_main
from tests.cli_runs import cli_env
from tests.helpers import SMALL

ROOT = Path(__file__).resolve().parents[2]

# Each breaks one layout rule: no layer for the second pipeline stage, 3 experts over 2
# expert-parallel ranks, one microbatch for an interleaved schedule of 2 x 2 chunks.
LAYOUT_ERRORS = {
    "pp2-one-layer": (["parallel.pp=2", "model.num_layers=1", "model.layer_pattern=K", "model.dense_layers=0"],
                      "cannot be split over parallel.pp=2"),
    "ep2-three-experts": (["parallel.ep=2", "moe.num_experts=3"], "moe.num_experts=3 is not divisible by parallel.ep=2"),
    "vpp-one-microbatch": (["parallel.pp=2", "parallel.vpp=2", "train.microbatches=1"],
                           "train.microbatches=1 cannot run the interleaved schedule"),
}


def _train(tmp_path, *argv):
    return ["train", "--run-dir", str(tmp_path / "run"), *argv]


@pytest.mark.parametrize("content", [bytes(range(256)), b"\xff\xfemodel:\n  hidden_size: 64\n"],
                         ids=["binary", "utf16-bom"])
def test_a_binary_config_file_is_one_line(tmp_path, capsys, content):
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    assert cli_main(_train(tmp_path, "--config", str(config))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3train: error: ") and "\n" not in err, err
    assert f"config file '{config}' is not UTF-8 text" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", sorted(LAYOUT_ERRORS))
def test_a_layout_error_is_said_by_rank_0_only(tmp_path, capsys, monkeypatch, case):
    """Every torchrun worker refuses the same config; RANK (torchrun's) decides who says it."""
    overrides, needle = LAYOUT_ERRORS[case]
    argv = _train(tmp_path, "--config", str(ROOT / "configs/k3_tiny.yaml"), *SMALL, *overrides)
    for rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        if says:
            assert err.startswith("k3train: error: invalid config: ") and "\n" not in err, err
            assert needle in err, err
        else:
            assert err == "", err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two worker processes under torchrun (~15 s)
def test_under_torchrun_a_layout_error_prints_once_and_fails(tmp_path):
    overrides, needle = LAYOUT_ERRORS["pp2-one-layer"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "k3train",
           *_train(tmp_path, "--config", "configs/k3_tiny.yaml", *SMALL, *overrides)]
    done = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert out.count("k3train: error:") == 1 and needle in out, out
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["proc-prefix", "tiktoken-duplicate-rank"])
def test_prepare_data_leftovers_are_one_line(tmp_path, capsys, case):
    """The issue's last prepare-data cases: an output prefix in /proc, a tiktoken file repeating a rank."""
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    argv = ["prepare-data", str(tmp_path / "a.txt"), "--split-lines"]
    if case == "proc-prefix":
        argv += ["--output-prefix", "/proc/k3train_fault_test_ds"]
        needle = "/proc/k3train_fault_test_ds"
    else:
        (tmp_path / "dup.tiktoken").write_text("aGVsbG8= 0\naGk= 0\n")  # "hello" and "hi", both rank 0
        argv += ["--output-prefix", str(tmp_path / "ds"), "--tokenizer", str(tmp_path / "dup.tiktoken")]
        needle = "rank 0 repeats"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3train: error: ") and "\n" not in err and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
