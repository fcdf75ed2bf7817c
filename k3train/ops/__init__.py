"""Kernels with backend dispatch: each op asks ``k3train.ops.kernels`` which backend its family runs
(Triton kernels on CUDA when installed, fla's or our own; torch elsewhere), as chosen by the
run's ``kernels:`` config section.
"""
from __future__ import annotations

import functools
import importlib

import torch

from k3train.ops import kernels


@functools.cache
def _fla_function(module: str, name: str):
    # Imported lazily: fla pulls in Triton, which CPU-only installs do not have.
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError:
        return None
    kernels.configure_triton()  # kernels.autotune applies to fla's autotuners from their first use
    return fn


def fla_kernel(family: str, device: torch.device | str, module: str, name: str):
    """fla's ``module.name`` when the registry picks fla for ``family`` on ``device``, else None."""
    return _fla_function(module, name) if kernels.backend(family, device) == "fla" else None
