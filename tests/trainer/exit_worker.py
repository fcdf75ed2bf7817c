"""``python -m k3train ...`` in a process that also holds queued work in an executor thread, as
a CUDA run holds Triton/Inductor compiles still queued when a SIGTERM stops it in step 1.

    python tests/trainer/exit_worker.py train --config ...

Python joins executor threads at exit, after they ran every queued item: here 60 x 5 s.
"""
import runpy
import sys
import time
from concurrent.futures import ThreadPoolExecutor

if __name__ == "__main__":
    compiles = ThreadPoolExecutor(1, thread_name_prefix="queued-compile")
    for _ in range(60):
        compiles.submit(time.sleep, 5)
    sys.argv = ["k3train", *sys.argv[1:]]
    runpy.run_module("k3train", run_name="__main__", alter_sys=True)
