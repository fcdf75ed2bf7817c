"""Run a test body in several local processes joined by a gloo process group.

Every parallel feature is proven on CPU this way: ``run_multiprocess(fn, world_size, *args)``
starts ``world_size`` processes, initialises ``torch.distributed`` with gloo over a free TCP
port on localhost, calls ``fn(rank, world_size, *args)`` in each, and re-raises the first
failure in the parent with the child's traceback. ``fn`` must be a module-level function so
that the child can import it.

The ranks fork from a ``forkserver`` that imported torch, megatron-core and k3train's trainer
(with the model, data, ``moe``, ``optim`` and ``pipeline`` under it; matplotlib is imported at
a run's first plot) once: about 9 s
of one core per process on the CI machine, which spawning paid for every rank of every test,
and then about 1 s per rank of every call for k3train's own modules, which the server now holds
too. The server only imports them (nothing of theirs but their import has run there), so each rank starts
from the state a fresh import gives. A fork from the server would inherit the server's
environment and working directory, so each rank takes the parent's current ones first: a
test's ``monkeypatch.setenv`` and ``chdir`` reach its ranks as they did with spawn. That
holds for the preloaded modules because they read the environment (``K3TRAIN_FAULTS``,
``K3TRAIN_KERNELS``, ``RANK``, ...) when called, never at import (tests/test_multiproc_harness.py
checks it). Triton, which megatron-core imports, decides on its interpreter at import: with
``TRITON_INTERPRET`` set the ranks are spawned fresh instead.
"""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the server imports once (a module that fails to import is skipped by multiprocessing,
# and the rank imports it itself, as before).
_PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "k3train.trainer.loop"]


def _entry(rank: int, world_size: int, port: int, fn, args, errors, env, cwd) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    # One thread per process: the CI machine has 2 cores and several ranks share them.
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:  # noqa: BLE001 - megatron may be unused by this test
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_multiprocess(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise on any failure."""
    # Triton's interpreter is chosen when Triton is imported, and the server has imported it
    # (megatron-core does): a test that turns the interpreter on gets freshly spawned ranks.
    method = "spawn" if os.environ.get("TRITON_INTERPRET") else "forkserver"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call)
    errors = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(_entry, args=(world_size, port, fn, args, errors, dict(os.environ), os.getcwd()),
                           nprocs=world_size, join=True, start_method=method)
    except mp.ProcessRaisedException as exc:
        details = []
        while not errors.empty():
            rank, tb = errors.get()
            details.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("multi-process test failed:\n" + "\n".join(details)) from exc
