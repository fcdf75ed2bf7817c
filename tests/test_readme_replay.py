"""The README in order, as a new user types it: the set-up line, the quickstart, then the fast
test tier, in a copy of this working tree and a temporary HOME. Each command must exit 0, the
quickstart's run must land inside the copy, and this repository's runs/ must stay untouched.

What is not run as written, and why: the ``pip install`` parts of the set-up line (no network,
and minutes) are checked instead to be the documented ones and to name only extras pyproject
declares; the activated environment is stood in for by this interpreter (``k3train`` ->
``python -m k3train`` with the copy first on ``PYTHONPATH``); the quickstart's ``train.steps``
is cut to 1 by an override (the README says any key can be overridden); the fast tier is
collected (``--collect-only``), not run: the suite inside the suite would take minutes.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import readme_commands

REPO = Path(__file__).resolve().parents[1]
SETUP_INSTALLS = ["pip install torch==2.13.0", 'pip install -e ".[dev]"']
FAST_TIER = 'python -m pytest -q -m "not slow"'


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}


def _copy_working_tree(dest: Path) -> None:
    """The files git tracks (and new ones it does not ignore) as they are on disk now."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())


def _extras(command: str) -> set[str]:
    m = re.search(r'-e "\.\[([^\]]*)\]"', command)
    return {e.strip() for e in m.group(1).split(",")} if m else set()


def _run(argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_the_readme_in_order_in_a_fresh_home(tmp_path):
    setup, quickstart, tests = readme_commands(REPO / "README.md")
    readme = (REPO / "README.md").read_text()
    runs_before = _tree(REPO / "runs")
    copy, home = tmp_path / "k3train", tmp_path / "home"
    copy.mkdir()
    home.mkdir()
    _copy_working_tree(copy)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(home), PYTHONPATH=str(copy), WANDB_MODE="offline")

    # 1. set-up: a virtual environment (as written), then the installs (checked, not run)
    parts = [p.strip() for p in setup.split("&&")]
    assert parts[0] == "python3 -m venv .venv" and parts[1] == ". .venv/bin/activate"
    assert parts[2:] == SETUP_INSTALLS
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set().union(*(_extras(c) for c in re.findall(r'pip install -e "\.\[[^\]]*\]"', readme)))
    assert "dev" in named and named <= declared, f"the README names extras {sorted(named - declared)} pyproject lacks"
    # the machine's python3, by path: the temporary HOME must not change which interpreter it is
    python3 = subprocess.run(["python3", "-c", "import sys; print(sys.executable)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    _run([python3, "-m", "venv", ".venv"], copy, env, timeout=300)
    assert (copy / ".venv" / "bin" / "python").exists()

    # 2. the quickstart, as written plus train.steps=1
    argv = shlex.split(quickstart)
    assert argv[:1] == ["k3train"] and argv[1:] == ["train", "--config", "configs/k3_tiny.yaml"]
    done = _run([sys.executable, "-m", "k3train", *argv[1:], "train.steps=1"], copy, env, timeout=600)
    assert "[k3train] done: step 1," in done.stdout
    run_dir = copy / "runs" / "k3_tiny"
    assert [r for r in (run_dir / "metrics.jsonl").read_text().splitlines()] and (run_dir / "checkpoints" / "latest").is_file()
    assert not (home / "runs").exists()

    # 3. the test command, and the fast tier the README names: collected, from the copy
    assert tests == "python -m pytest -q" and FAST_TIER in readme
    collect = shlex.split(FAST_TIER)[1:] + ["--collect-only", "-p", "no:cacheprovider"]
    done = _run([sys.executable, *collect], copy, env, timeout=600)
    summary = done.stdout.strip().splitlines()[-1]
    m = re.match(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", summary)
    assert m and int(m.group(1)) > 100 and int(m.group(3)) > 0, summary  # the slow tests left out
    node_ids = [line for line in done.stdout.splitlines() if line.startswith("tests/") and "::" in line]
    assert len(node_ids) == int(m.group(1))
    assert "tests/test_readme.py::test_readme_starts_with_setup_run_and_test_commands" in node_ids
    assert "tests/test_readme_replay.py::test_the_readme_in_order_in_a_fresh_home" not in node_ids  # slow

    assert _tree(REPO / "runs") == runs_before, "the README's replay wrote into this repository's runs/"
