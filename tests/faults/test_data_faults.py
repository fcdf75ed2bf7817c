"""Fault cases of the data commands and sweeps (issue 44, items 3, 6, 7 data part, 10).

Every bad-input case runs through the CLI (``k3train.cli.main``): exit status 2, one line on
stderr and no traceback, and the directory listed before and after is unchanged (names, sizes,
modification times)."""
import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import k3train.trainer.loop as loop
from k3train.cli import main as cli_main
from k3train.data import ByteTokenizer, prepare_data
from k3train.data.dataset import dataset_content_hash
from k3train.sweep import runner
from tests.cli_runs import cli_env, wait_for
from tests.helpers import SMALL

TOK = ByteTokenizer()


def _listing(root: Path) -> dict:
    """Every path under ``root`` -> (is a dir, size, mtime_ns): what "nothing changed" compares."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def _one_line_refusal(capsys, argv: list[str], *must_name: str) -> str:
    """Run the CLI, expect exit 2 and exactly one stderr line naming ``must_name``."""
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3train: error: "), err
    assert "Traceback" not in err
    for text in must_name:
        assert text in lines[0], (text, lines[0])
    return lines[0]


# --- item 3: --workers capped at the cores available ------------------------------------------

def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def test_workers_request_is_capped_at_the_cores(tmp_path, monkeypatch, capsys):
    """``--workers 10000`` builds a pool of at most the available cores (the pool class replaced
    by an in-process recorder: no process starts), says so on one stderr line, and writes the
    same bytes as one worker."""
    sizes = []

    class RecordingPool:
        def __init__(self, processes, initializer=None, initargs=()):
            sizes.append(processes)
            if initializer is not None:
                initializer(*initargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def apply_async(self, fn, args):
            result = fn(*args)
            return type("Done", (), {"get": lambda self: result})()

    spawn = multiprocessing.get_context("spawn")  # the code's context (a process-wide singleton)
    monkeypatch.setattr(spawn, "Pool", RecordingPool, raising=False)
    (tmp_path / "d.txt").write_text("alpha\nbeta\ngamma\n")
    prepare_data([tmp_path / "d.txt"], tmp_path / "one", TOK, txt_split="lines", workers=1)
    capsys.readouterr()
    prepare_data([tmp_path / "d.txt"], tmp_path / "many", TOK, txt_split="lines", workers=10000)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    cap = _cores()
    assert all(s <= cap for s in sizes), (sizes, cap)
    if cap > 1:
        assert sizes == [cap]
    assert len(err) == 1 and "10000" in err[0] and f"capped at {cap}" in err[0], err
    assert (tmp_path / "many.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()


# --- item 6: no output replaced without --overwrite --------------------------------------------

def test_prepare_data_refuses_to_replace_a_dataset_without_overwrite(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.txt").write_text("one\ntwo\nthree\nfour\n")
    prefix = tmp_path / "ds"
    base = ["prepare-data", "--split-lines", "--output-prefix", str(prefix)]
    assert cli_main([*base, str(tmp_path / "a.txt")]) == 0
    capsys.readouterr()
    before = _listing(tmp_path)
    _one_line_refusal(capsys, [*base, str(tmp_path / "b.txt")], str(prefix), "--overwrite")
    assert _listing(tmp_path) == before
    assert json.loads((tmp_path / "ds.meta.json").read_text())["num_documents"] == 2
    # The flag replaces it: the new dataset's 4 documents.
    assert cli_main([*base, str(tmp_path / "b.txt"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "ds.meta.json").read_text())["num_documents"] == 4
    # Library keyword, same rule.
    with pytest.raises(Exception, match="--overwrite"):
        prepare_data([tmp_path / "a.txt"], prefix, TOK)


def test_train_tokenizer_refuses_to_replace_a_tokenizer_without_overwrite(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 40)
    (tmp_path / "b.txt").write_text("a dog ran far away; the dog sat down. " * 40)
    out = tmp_path / "tok"
    base = ["train-tokenizer", "--vocab-size", "300", "--out", str(out)]
    assert cli_main([*base, str(tmp_path / "a.txt")]) == 0
    capsys.readouterr()
    first = (out / "tokenizer.json").read_bytes()
    before = _listing(tmp_path)
    _one_line_refusal(capsys, [*base, str(tmp_path / "b.txt")], str(out / "tokenizer.json"), "--overwrite")
    assert _listing(tmp_path) == before
    assert cli_main([*base, str(tmp_path / "b.txt"), "--overwrite"]) == 0
    assert (out / "tokenizer.json").read_bytes() != first


# --- item 7 (data part): hostile inputs and unwritable outputs are one line, nothing written ---

def _refused(tmp_path, capsys, inp: Path, prefix: Path, *must_name: str) -> None:
    before = _listing(tmp_path)
    _one_line_refusal(capsys, ["prepare-data", str(inp), "--output-prefix", str(prefix)], *must_name)
    assert _listing(tmp_path) == before


def test_non_utf8_jsonl_is_one_line(tmp_path, capsys):
    inp = tmp_path / "bad.jsonl"
    inp.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    _refused(tmp_path, capsys, inp, tmp_path / "sub" / "ds", str(inp), "UTF-8")


def test_lone_surrogate_escape_is_one_line(tmp_path, capsys):
    inp = tmp_path / "sur.jsonl"
    inp.write_text('{"text": "ok"}\n{"text": "x\\ud800y"}\n')
    _refused(tmp_path, capsys, inp, tmp_path / "ds", f"{inp}:2", "surrogate")


def test_fake_parquet_is_one_line(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    inp = tmp_path / "fake.parquet"
    inp.write_bytes(np.random.default_rng(0).bytes(4096))
    _refused(tmp_path, capsys, inp, tmp_path / "ds", str(inp), "parquet")


def test_output_prefix_under_a_regular_file_is_one_line(tmp_path, capsys):
    inp = tmp_path / "a.txt"
    inp.write_text("hello")
    (tmp_path / "plain").write_text("a user's file")
    _refused(tmp_path, capsys, inp, tmp_path / "plain" / "deeper" / "ds", str(tmp_path / "plain"), "not a directory")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_prefix_in_a_read_only_directory_is_one_line(tmp_path, capsys):
    inp = tmp_path / "a.txt"
    inp.write_text("hello")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        _refused(tmp_path, capsys, inp, ro / "ds", str(ro), "not writable")
    finally:
        ro.chmod(0o755)


# --- item 10: empty documents counted; a stopped sweep exits with its own status ---------------

def test_empty_documents_are_counted_in_the_summary(tmp_path, capsys):
    inp = tmp_path / "d.jsonl"
    inp.write_text("\n".join(json.dumps({"text": t}) for t in ["a", "", "bc", "", "", "d"]) + "\n")
    assert cli_main(["prepare-data", str(inp), "--output-prefix", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "3 documents" in out and "3 empty documents skipped" in out, out


def test_sweep_stopped_with_variants_left_exits_with_its_own_status(tmp_path, monkeypatch, capsys):
    """The second of three variants returns early (what a stop signal makes ``train`` do): the
    third never starts, and the command exits EXIT_SWEEP_STOPPED (3), not 0."""
    # 3 is the documented status (docs/ablations.md); the default lets this test fail, not error, on
    # code without the constant.
    EXIT_SWEEP_STOPPED = getattr(runner, "EXIT_SWEEP_STOPPED", 3)
    assert EXIT_SWEEP_STOPPED == 3
    calls = []

    def fake_train(cfg, run_dir, resume=False):
        run_dir.mkdir(parents=True, exist_ok=True)
        calls.append(run_dir.name)
        return {"steps": 1 if len(calls) == 2 else cfg.train.steps}

    monkeypatch.setattr(loop, "train", fake_train)
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump({"name": "unit", "base": str(Path("configs/k3_tiny.yaml").resolve()),
                                    "overrides": ["train.steps=4"],
                                    "grid": {"optim.lr": [1e-3, 2e-3, 3e-3]}}))
    out = tmp_path / "out"
    assert cli_main(["sweep", str(path), "--out", str(out)]) == EXIT_SWEEP_STOPPED
    assert len(calls) == 2, calls
    err = capsys.readouterr().err
    assert "Traceback" not in err and "2 variant(s) left" in err, err
    assert (out / calls[0] / "DONE").is_file() and not (out / calls[1] / "DONE").exists()
    # A rerun resumes: the stopped variant and the one never started train, and it exits 0.
    calls.clear()
    monkeypatch.setattr(loop, "train", lambda cfg, run_dir, resume=False: calls.append(run_dir.name)
                        or run_dir.mkdir(parents=True, exist_ok=True) or {"steps": cfg.train.steps})
    assert cli_main(["sweep", str(path), "--out", str(out)]) == 0
    assert len(calls) == 2


@pytest.mark.slow
def test_signalled_sweep_exits_3_and_starts_no_further_variant(tmp_path):
    """A real ``k3train sweep`` process signalled while its first variant trains: the variant
    saves, the second variant never starts, and the process exits 3. SIGTERM and SIGINT, one
    sweep each, run side by side (each child trains on one thread; the machine has two)."""
    procs = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        path = tmp_path / sig.name / "ablation.yaml"
        path.parent.mkdir()
        path.write_text(yaml.safe_dump({"name": "unit", "base": str(Path("configs/k3_tiny.yaml").resolve()),
                                        "overrides": [*SMALL, "train.steps=100000", "train.log_interval=1"],
                                        "grid": {"optim.lr": [1e-3, 2e-3]}}))
        out = tmp_path / sig.name / "out"
        procs[sig] = out, subprocess.Popen([sys.executable, "-m", "k3train", "sweep", str(path), "--out", str(out)],
                                           env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    signalled, logs = set(), {}
    try:
        for sig, (out, proc) in procs.items():
            first = out / "lr-0.001" / "metrics.jsonl"
            try:
                assert wait_for(lambda: first.exists() and len(first.read_text().splitlines()) >= 2), sig.name
            finally:
                proc.send_signal(sig)
                signalled.add(sig)
    finally:
        for sig, (out, proc) in procs.items():
            if sig not in signalled:  # an earlier wait failed: this one must not train on
                proc.kill()
            logs[sig], _ = proc.communicate(timeout=180)
    for sig, (out, proc) in procs.items():
        log = logs[sig]
        assert proc.returncode == 3, (sig.name, log)
        assert (out / "lr-0.001" / "checkpoints" / "latest").is_file(), (sig.name, log)
        assert not (out / "lr-0.002").exists(), (sig.name, log)
        assert "Traceback" not in log and "1 variant(s) left" not in log and "2 variant(s) left" in log, (sig.name, log)


def test_dataset_records_its_content_hash(tmp_path):
    """Item 6 (data side): the meta file records sha256(.bin bytes + .idx bytes), so data
    re-prepared at the same prefix is told apart from the data a checkpoint was trained on."""
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.txt").write_text("one\ntwo\nthree\n")
    prefix = tmp_path / "ds"
    prepare_data([tmp_path / "a.txt"], prefix, TOK, txt_split="lines")
    reference = hashlib.sha256((tmp_path / "ds.bin").read_bytes() + (tmp_path / "ds.idx").read_bytes()).hexdigest()
    first = dataset_content_hash(prefix)
    assert first == reference
    prepare_data([tmp_path / "a.txt"], tmp_path / "same", TOK, txt_split="lines")
    assert dataset_content_hash(tmp_path / "same") == first  # the path is not part of it
    prepare_data([tmp_path / "b.txt"], prefix, TOK, txt_split="lines", overwrite=True)
    assert dataset_content_hash(prefix) not in (None, first)
    assert dataset_content_hash(tmp_path / "absent") is None
