"""Every thread's Python stack, printed every few seconds by a daemon thread that holds the GIL.

    python3 -m benchmarks.stack_sampler S -m k3train train ...   # run a module, sampled every S s

``faulthandler.dump_traceback_later`` does the same from a C watchdog thread without the GIL, so
it reads other threads' frames while they change: on an H200 it crashed ``k3train train`` with
SIGSEGV at a dump, twice (at 90 s and 120 s, Triton compiling on 16 threads; see
benchmarks/README.md). Here the frames come from ``sys._current_frames()`` under
the GIL, which is safe; the cost is that a thread stuck in C code holding the GIL delays the
dump until it lets go.
"""
from __future__ import annotations

import runpy
import sys
import threading
import time
import traceback


def format_stacks(skip: int | None = None) -> str:
    """Every live thread's stack (most recent call last), one block per thread, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        stack = "".join(traceback.format_stack(frame))
        blocks.append(f"Thread {names.get(ident, '?')} ({ident:#x}):\n{stack}")
    return "\n".join(blocks)


def start(interval: float, out=None) -> threading.Thread:
    """Start a daemon thread printing :func:`format_stacks` to ``out`` (stderr) every ``interval`` s."""
    out = out or sys.stderr

    def loop():
        t0 = time.perf_counter()
        while True:
            time.sleep(interval)
            text = format_stacks(skip=threading.get_ident())
            out.write(f"--- stacks at {time.perf_counter() - t0:.0f} s ---\n{text}\n")
            out.flush()

    thread = threading.Thread(target=loop, name="stack_sampler", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        sys.exit("usage: stack_sampler.py SECONDS -m MODULE [ARGS ...]")
    interval = float(argv[0])
    if interval <= 0:
        sys.exit(f"stack_sampler.py: SECONDS must be > 0, got {argv[0]}")
    start(interval)
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
