"""scripts/launch_single_node.sh (through scripts/run_torchrun.sh) at DP=2 on CPU: its exit
status is the workers' outcome, which SLURM requeue logic relies on."""
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing import api as elastic_processes

from k3train.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from tests.helpers import SMALL

_spec = importlib.util.spec_from_file_location(
    "torchrun_stop_once", Path(__file__).resolve().parents[2] / "scripts" / "torchrun_stop_once.py")
torchrun_stop_once = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torchrun_stop_once)  # a script, not a module of a package

LAUNCH = ["bash", "scripts/launch_single_node.sh", "2", "configs/k3_tiny.yaml"]


def _env(**extra):
    bindir = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHON=sys.executable,
               PATH=f"{bindir}:{os.environ.get('PATH', '')}")
    env.pop("K3TRAIN_FAULTS", None)
    env.update(extra)
    return env


def _processes(pgid: int) -> str:
    """``ps`` rows (pid, parent, state, age, command) of the launch's process group: which of
    wrapper, torchrun, shims and workers is still alive when a launch hangs."""
    rows = subprocess.run(["ps", "-e", "-o", "pgid=,pid=,ppid=,stat=,etime=,args="], capture_output=True,
                          text=True).stdout.splitlines()
    return "\n".join(r[:200] for r in rows if r.split() and r.split()[0] == str(pgid))


def _launch(run_dir: Path, *overrides: str, **env) -> subprocess.Popen:
    """The launch, in a session of its own, its output (wrapper, agent, workers) in
    ``run_dir/launch.log`` so that a test can watch it while the launch runs."""
    log = open(run_dir / "launch.log", "w")  # noqa: SIM115 - the child holds it; closed below
    with log:
        return subprocess.Popen([*LAUNCH, "--run-dir", str(run_dir), *SMALL, *overrides], env=_env(**env),
                                stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _output(run_dir: Path) -> str:
    return (run_dir / "launch.log").read_text(errors="replace")


def _wait_for(condition, what: str, timeout: float = 150):
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.1)


def _first_step_logged(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and bool(metrics.read_text().strip())


def _finish(proc, run_dir: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        alive = _processes(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the launch did not finish in {timeout} s; still running:\n{alive}\n"
                    f"output:\n{_output(run_dir)[-6000:]}")
    return _output(run_dir)


def _tree(root: int) -> list[int]:
    """``root`` and every process descended from it (SLURM signals all of a step's processes,
    whatever their session: torchrun starts each worker in a session of its own)."""
    rows = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children: dict[int, list[int]] = {}
    for pid, ppid in zip(map(int, rows[::2]), map(int, rows[1::2])):
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        tree.append(pid := todo.pop())
        todo.extend(children.get(pid, []))
    return tree


def test_the_agent_acts_on_its_first_stop_signal_only():
    """scripts/torchrun_stop_once.py: torchrun's handler raises for the first signal only; a
    repeat (either kind) returns, so it cannot interrupt the shutdown the first one started."""
    handle = torchrun_stop_once.first_signal_only(elastic_processes._terminate_process_handler)
    with pytest.raises(SignalException) as first:
        handle(signal.SIGTERM, None)
    assert first.value.sigval == signal.SIGTERM
    assert handle(signal.SIGTERM, None) is None and handle(signal.SIGINT, None) is None


@pytest.mark.slow
def test_sigterm_to_the_process_group_saves_and_exits_zero(tmp_path):
    # A worker still alive 120 s after its start (this run takes about 15) prints its threads'
    # stacks (K3TRAIN_STACKS_AFTER), so that a hang says where it waits.
    proc = _launch(tmp_path, "train.steps=100000", "train.log_interval=1", K3TRAIN_STACKS_AFTER="120")
    _wait_for(lambda: _first_step_logged(tmp_path) or proc.poll() is not None, "first step")
    # TERM to the launch's process group (Ctrl-C in a terminal does the same with INT): the
    # wrapper and the torchrun agent; the agent gets the wrapper's forwarded copy too. The
    # workers, each in a session of its own (torchrun starts them so), get theirs from the
    # agent and their shim.
    os.killpg(proc.pid, signal.SIGTERM)
    out = _finish(proc, tmp_path, timeout=150)
    assert proc.returncode == 0, out[-4000:]
    assert "signal received: saved step" in out and "all 2 workers on this node saved and exited 0" in out
    manifest = verify_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), world_size=2)
    assert manifest["step"] >= 1


@pytest.mark.slow
def test_a_failed_worker_is_reported_as_failure(tmp_path):
    proc = _launch(tmp_path, "train.steps=3", K3TRAIN_FAULTS="crash@2")
    out = _finish(proc, tmp_path, timeout=200)
    assert proc.returncode != 0 and "crashing at step 2" in out, out[-3000:]


@pytest.mark.slow
def test_a_repeated_term_to_the_agent_while_it_stops_still_saves_and_exits_zero(tmp_path):
    # SLURM's --signal TERMs every process of the step; the wrapper then forwards its copy to
    # the agent, which may land after the agent began stopping (CI, 2026-12-02 and -04: the
    # agent ran its shutdown twice, sent each worker two rounds of closing signals and did not
    # exit). Here the repeat is sent deliberately once the agent has logged the first.
    proc = _launch(tmp_path, "train.steps=100000", "train.log_interval=1")
    _wait_for(lambda: _first_step_logged(tmp_path) or proc.poll() is not None, "first step")
    agent = int(subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                               text=True).stdout.split()[0])
    for pid in _tree(proc.pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:  # a process that ended meanwhile
            pass
    _wait_for(lambda: "death signal, shutting down workers" in _output(tmp_path) or proc.poll() is not None,
              "stop by the agent", timeout=60)
    try:
        os.kill(agent, signal.SIGTERM)
    except ProcessLookupError:
        pass
    out = _finish(proc, tmp_path, timeout=120)
    assert proc.returncode == 0, out[-4000:]
    assert "all 2 workers on this node saved and exited 0" in out, out[-4000:]
    # one shutdown: each of the two workers got one closing signal from the agent (two each
    # when the repeat started a second shutdown), and the repeat was ignored
    assert out.count("closing signal SIGTERM") == 2, out[-4000:]
    assert "torchrun agent: SIGTERM ignored, already stopping on SIGTERM" in out, out[-4000:]
    manifest = verify_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), world_size=2)
    assert manifest["step"] >= 1
