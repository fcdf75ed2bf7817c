"""Multi-rank run lifecycle at DP=2 on CPU (gloo): a stop signal that reaches one rank only,
``torchrun --max-restarts`` after a dying worker, and the cost of the per-step stop agreement.

Every run is compared with one uninterrupted DP=2 run of the same config (the reference):
losses must match bit for bit."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from k3train.config import load_config
from k3train.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from k3train.trainer.loop import train
from k3train.trainer.state_io import consolidated_state
from k3train.trainer.stop import stop_agreed
from tests.helpers import SMALL, read_records
from tests.multiproc import run_multiprocess

ARGS = [*SMALL, "train.steps=4", "train.log_interval=1", "checkpoint.interval=2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TRAIN = ["train", "--config", "configs/k3_tiny.yaml"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("K3TRAIN_FAULTS", None)
    env.update(extra)
    return env


def _run(cmd, timeout, **env):
    """Run ``cmd`` in its own session; on timeout kill the whole group (torchrun and its
    workers) and fail, so a deadlocked run cannot outlive the test."""
    proc = subprocess.Popen(cmd, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:8])} ... did not finish in {timeout} s (deadlock?):\n{out[-3000:]}")
    return proc.returncode, out


def _train_rank(rank, world_size, run_dir, resume=False):
    train(load_config("configs/k3_tiny.yaml", ARGS), run_dir, resume=resume)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted DP=2 run: {step: loss} and its final model state (rank 0). Two gloo
    ranks forked from the preloaded server (tests/multiproc.py) run the same ``train`` that
    ``k3train train`` runs under torchrun; the runs under test keep torchrun, and the reference
    skips its interpreters' start-up."""
    run = tmp_path_factory.mktemp("reference")
    run_multiprocess(_train_rank, 2, run)
    return {r["step"]: r["loss"] for r in read_records(run)}, _model(run)


def _model(run):
    return consolidated_state(latest_checkpoint(run / "checkpoints"))["model"]


def _assert_matches(run, reference):
    losses, model = reference
    assert {r["step"]: r["loss"] for r in read_records(run)} == losses
    mine = _model(run)
    assert mine.keys() == model.keys()
    for name, value in model.items():
        assert torch.equal(value, mine[name]), name


@pytest.mark.slow
def test_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, reference):
    # Rank 1 alone gets SIGTERM, at the start of step 2 (rank 0 would get one at step 3, too
    # late: it must already have stopped with rank 1). Before the agreement, rank 1 waited in
    # the save's barrier while rank 0 waited in step 3's gradient all-reduce: a deadlock.
    run = tmp_path / "run"
    rc, out = _run([*TORCHRUN, "tests/trainer/signal_worker.py", "1@2,0@3", *TRAIN, "--run-dir", str(run),
                    *ARGS], timeout=150)
    assert rc == 0, out[-3000:]
    assert "signal received: saved step 2" in out
    ckpt = latest_checkpoint(run / "checkpoints")
    manifest = verify_checkpoint(ckpt, world_size=2)
    assert manifest["step"] == 2 and sorted(manifest["files"]) == ["rank_00000.pt", "rank_00001.pt"]
    # Both ranks saved the same step: each rank file records step 2.
    for name in manifest["files"]:
        assert torch.load(ckpt / name, weights_only=False)["step"] == 2
    # The resume on two gloo ranks (a resume under torchrun is the elastic test's).
    run_multiprocess(_train_rank, 2, run, True)
    _assert_matches(run, reference)


@pytest.mark.slow
def test_elastic_restart_two_processes_matches_uninterrupted_run(tmp_path, reference):
    # Both workers die at the start of step 3 (first attempt only); torchrun restarts them,
    # they resume from step 2. Before the per-attempt store prefix, the restarted ranks failed
    # in gloo's connectFullMesh ("Connection refused"): they read the dead attempt's addresses.
    run = tmp_path / "elastic"
    cmd = [*TORCHRUN, "--max-restarts", "1", "-m", "k3train", *TRAIN, "--run-dir", str(run), "--resume", *ARGS]
    rc, out = _run(cmd, timeout=300, K3TRAIN_FAULTS="crash@3")
    assert rc == 0, out[-3000:]
    assert "crashing at step 3" in out and "resumed from" in out and "connectFullMesh" not in out
    _assert_matches(run, reference)


def _count_agreement_traffic(rank, world_size, calls, out_file):
    cpu = torch.device("cpu")
    # Rank 1 requests a stop on the last call only: every rank must see it there, and only there.
    sent = []
    real = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name):
        def call(tensor_or_list, *args, **kwargs):
            tensors = tensor_or_list if isinstance(tensor_or_list, (list, tuple)) else [tensor_or_list]
            sent.append((name, sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))))
            return real[name](tensor_or_list, *args, **kwargs)
        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        seen = [stop_agreed(rank == 1 and i == calls - 1, cpu) for i in range(calls)]
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    assert seen == [False] * (calls - 1) + [True]
    if rank == 0:
        out_file.write_text(json.dumps({"sent": sent}))


# Every collective a per-step agreement could use; the agreement must use one all-reduce only.
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter",
                "send", "recv", "isend", "irecv")


@pytest.mark.slow
def test_stop_agreement_is_a_max_over_ranks_and_cheap(tmp_path):
    # Cheap as a count, not a clock (speed belongs to benchmarks): one all-reduce of one int32
    # flag per step, no other collective, no host round trip beyond reading that flag.
    out_file = tmp_path / "traffic.json"
    calls = 20
    run_multiprocess(_count_agreement_traffic, 2, calls, out_file)
    sent = json.loads(out_file.read_text())["sent"]
    assert sent == [["all_reduce", 4]] * calls
