"""One switch for the small elementwise/reduction pieces that run through ``torch.compile``."""
from __future__ import annotations

import functools
from typing import Callable

import torch

_ENABLED = {"cuda": True}


def set_compile(enabled: bool) -> None:
    """Whether CUDA calls go through ``torch.compile``. Called by ``k3train.kernels.apply`` from
    the run's ``kernels.compile`` (off for pipeline GPU runs by default); nothing else sets it."""
    _ENABLED["cuda"] = bool(enabled)


def compile_on_cuda(fn: Callable, **options) -> Callable:
    """``fn`` through ``torch.compile(fn, **options)`` when its first argument is a CUDA tensor
    and compiling is on (``set_compile``), eager otherwise (debugging, pipeline runs, a torch
    without Inductor). The compile happens at the first CUDA call."""
    compiled = functools.cache(lambda: torch.compile(fn, **options))

    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        if first.is_cuda and _ENABLED["cuda"]:
            return compiled()(first, *args, **kwargs)
        return fn(first, *args, **kwargs)

    return run
