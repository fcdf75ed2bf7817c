"""One switch for the small elementwise/reduction pieces that run through ``torch.compile``."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

from .backends import current as current_backends


def autocast_free(device_type: str):
    """A context with autocast off on ``device_type`` and its cast cache at the default (on):
    the autocast state a compiled function with explicit casts should always be entered in
    (``compile_for(outside_autocast=True)``); a no-op context when that is already the state."""
    if torch.is_autocast_enabled(device_type) or not torch.is_autocast_cache_enabled():
        return torch.autocast(device_type, enabled=False, cache_enabled=True)
    return contextlib.nullcontext()


def compile_for(fn: Callable, *, device_types: tuple[str, ...] = ("cuda",),
                outside_autocast: bool = False, **options) -> Callable:
    """``fn`` through ``torch.compile(fn, **options)`` when its first argument is a tensor on one
    of ``device_types`` and compiling is on (``moe.backends``' ``compile``, from the run's
    ``kernels.compile``; off for pipeline GPU runs by default), eager otherwise (debugging,
    pipeline runs, a torch without Inductor). The compile happens at the first such call.

    ``outside_autocast=True`` runs the compiled call with autocast off on the tensor's device
    and its cast cache at the default (on). Dynamo guards on both (enabled, and
    ``cache_enabled``, which the CUDA-graphed step turns off), so a function entered inside and
    outside autocast (the graphed training forward, evaluation) compiled once per state and ran
    into the recompile limit sooner. Only for functions that cast explicitly
    (every dtype they compute in is chosen by their arguments): for them autocast changes
    nothing, so turning it off changes no result and removes the guard."""
    compiled = functools.cache(lambda: torch.compile(fn, **options))

    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        if first.device.type not in device_types or not current_backends().compile:
            return fn(first, *args, **kwargs)
        if outside_autocast:
            with autocast_free(first.device.type):
                return compiled()(first, *args, **kwargs)
        return compiled()(first, *args, **kwargs)

    return run


def compile_on_cuda(fn: Callable, **options) -> Callable:
    """``compile_for(fn, device_types=("cuda",), **options)``: the pieces compile on CUDA only."""
    return compile_for(fn, device_types=("cuda",), **options)
