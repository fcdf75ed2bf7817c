"""Running our Triton kernels under Triton's CPU interpreter, for tests on machines without a GPU.

Triton must be imported with ``TRITON_INTERPRET=1`` for its own library functions to be
interpreted, so the kernels run in a child process. The child gets the source of ``helper``
(a function building its inputs, shared with the test's reference), then ``child``; it reads
``sys.argv[1]`` (``repr(cases)``) and saves its results with ``torch.save`` to ``sys.argv[2]``.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from typing import Any, Callable

import torch


def run_interpreted(tmp_dir, helper: Callable, child: str, cases: list) -> Any:
    """Run ``source(helper) + child`` with the interpreter on; return what it saved."""
    path = tmp_dir / "out.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", inspect.getsource(helper) + child, repr(cases),
                           str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(path)
