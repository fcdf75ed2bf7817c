"""Kernels with backend dispatch: each op reads ``k3train.ops.backends.current()`` for the backend
its family runs (Triton kernels on CUDA when installed, fla's or our own; torch elsewhere), as
resolved once from the run's ``kernels:`` config section by ``k3train.ops.kernels``.
"""
from __future__ import annotations

import functools
import importlib

import torch

from k3train.ops import backends as ops_backends
from k3train.ops import kernels  # noqa: F401 - resolves and delivers the default choices
from k3train.ops.triton_compile import configure_autotune


@functools.cache
def _fla_function(module: str, name: str):
    # Imported lazily: fla pulls in Triton, which CPU-only installs do not have.
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError:
        return None
    configure_autotune()  # kernels.autotune applies to fla's autotuners from their first use
    return fn


def fla_kernel(family: str, device: torch.device | str, module: str, name: str):
    """fla's ``module.name`` when the registry picks fla for ``family`` on ``device``, else None."""
    return _fla_function(module, name) if ops_backends.current().backend(family, torch.device(device).type) == "fla" else None
