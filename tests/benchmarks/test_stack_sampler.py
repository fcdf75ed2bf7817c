"""benchmarks/stack_sampler.py: the periodic all-thread stack dump that bench_first_step's
``--stacks`` runs the trainer under (faulthandler's C-level dump crashed the run on an H200)."""
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
import benchmarks.stack_sampler as stack_sampler  # noqa: E402


def _parked_in_a_named_function(ready: threading.Event, release: threading.Event):
    ready.set()
    release.wait(30)


def test_format_stacks_names_every_thread_and_its_current_function():
    ready, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_parked_in_a_named_function, args=(ready, release), name="parked-worker")
    worker.start()
    try:
        assert ready.wait(10)
        text = stack_sampler.format_stacks()
    finally:
        release.set()
        worker.join()
    blocks = text.split("\nThread ")
    mine = [b for b in blocks if "parked-worker" in b]
    assert len(mine) == 1, text
    assert "_parked_in_a_named_function" in mine[0] and "release.wait(30)" in mine[0]
    assert any("MainThread" in b and "test_format_stacks_names_every_thread" in b for b in blocks), text
    # the skipped thread (the sampler's own, when it dumps) is left out
    assert "test_format_stacks_names_every_thread" not in stack_sampler.format_stacks(skip=threading.get_ident())


def test_runs_the_module_with_its_arguments_and_dumps_while_it_runs(tmp_path):
    mod = tmp_path / "sleepy_mod.py"
    mod.write_text("import sys, time\nprint('argv', sys.argv[1:], flush=True)\n"
                   "def waiting_here():\n    time.sleep(1.5)\nwaiting_here()\nprint('done', flush=True)\n")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/stack_sampler.py"), "0.4", "-m", "sleepy_mod",
                          "a", "--b"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "argv ['a', '--b']" in out.stdout and "done" in out.stdout
    dumps = out.stderr.split("--- stacks at ")[1:]
    assert len(dumps) >= 2, out.stderr
    assert all("waiting_here" in d for d in dumps[:2]), out.stderr


def test_refuses_a_bad_interval_in_one_line():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/stack_sampler.py"), "0", "-m", "json.tool"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and out.stderr.strip().splitlines() == [
        "stack_sampler.py: SECONDS must be > 0, got 0"]
