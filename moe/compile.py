"""One switch for the small elementwise/reduction pieces that run through ``torch.compile``."""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch


def compile_on_cuda(fn: Callable, **options) -> Callable:
    """``fn`` through ``torch.compile(fn, **options)`` when its first argument is a CUDA tensor,
    eager otherwise or with ``K3TRAIN_COMPILE=0`` (debugging, pipeline runs, a torch without
    Inductor). The compile happens at the first CUDA call."""
    compiled = functools.cache(lambda: torch.compile(fn, **options))

    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        if first.is_cuda and os.environ.get("K3TRAIN_COMPILE", "1") != "0":
            return compiled()(first, *args, **kwargs)
        return fn(first, *args, **kwargs)

    return run
