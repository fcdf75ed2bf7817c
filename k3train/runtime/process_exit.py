"""Ending a k3train process promptly once its work is saved.

A SIGTERM on CUDA during step 1, while kernels were still compiling, printed "saved step 1 ...
exiting" and the process then lived on for over five minutes. What Python does after ``main``
returns explains it; each of these waits on work nobody needs any more:

* torch Inductor's compile pool (``torch.compile``, on CUDA in k3train's fused ops): its
  ``atexit`` handler sends the sidecar process a shutdown message and then waits
  ``process.wait(300)``, five minutes, for it; the sidecar may be stuck behind compile jobs
  or have lost its workers to the same SIGTERM (SLURM signals every process of the step).
* ``concurrent.futures`` joins every executor thread at exit, a compile that outlives the
  run included (Triton compiles run in such threads).
* The NCCL process group was never destroyed, so its teardown was left to interpreter exit,
  where it can block on a communicator whose peers are gone.

``finish_process`` runs after the run returned (checkpoint and metrics written, wandb closed):
it kills Inductor's compile workers instead of waiting for them, destroys the process groups,
and, when non-daemon threads or child processes are still alive, leaves with ``os._exit``
(no ``atexit``, nothing left to save). Otherwise it returns and Python exits normally.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading


def stop_inductor_compile_workers() -> int:
    """Kill torch Inductor's compile-worker pools, if this process started any; returns how
    many. Never imports Inductor (a run that did not use it has none)."""
    mod = sys.modules.get("torch._inductor.async_compile")
    pools = list(getattr(mod, "_pool_set", ()) or ())
    for pool in pools:
        try:
            sidecar = getattr(pool, "process", None)  # SubprocPool: a subprocess.Popen
            if sidecar is not None:
                sidecar.kill()
                sidecar.wait(5)
            for worker in list(getattr(pool, "_processes", {}).values()):  # a ProcessPoolExecutor
                worker.kill()
            try:  # returns at once now: nothing is left to wait for
                pool.shutdown(wait=False, cancel_futures=True)
            except TypeError:  # SubprocPool.shutdown() takes no arguments
                pool.shutdown()
        except Exception:  # noqa: BLE001 - the pool is going away either way
            pass
    if pools:
        mod.after_fork()  # forget the pools, so Inductor's own atexit handler finds none
    return len(pools)


def _blockers() -> list[str]:
    threads = [t.name for t in threading.enumerate()
               if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    children = [f"child process {p.pid}" for p in multiprocessing.active_children()]
    return [f"thread {name}" for name in threads] + children


def finish_process(code: int) -> None:
    """Tear down what would delay the exit (see the module docstring); ``os._exit(code)`` if
    threads or child processes would still block it, else return."""
    stopped = stop_inductor_compile_workers()
    try:
        if "k3train.runtime.distributed" in sys.modules:  # a command that never used torch imports none
            sys.modules["k3train.runtime.distributed"].shutdown_distributed()
    except Exception as exc:  # noqa: BLE001 - the run's outputs are written; exit regardless
        print(f"[k3train] process-group teardown failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    blockers = _blockers()
    if blockers:
        print(f"[k3train] exiting with status {code} without waiting for {', '.join(blockers)}"
              f"{f' ({stopped} compile pool(s) stopped)' if stopped else ''}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
