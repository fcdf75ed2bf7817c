"""Kernels with backend dispatch: Triton kernels on CUDA when importable (fla's, and our own
short convolution), torch elsewhere.

``K3TRAIN_KERNELS=torch`` forces the pure-torch forms on every device (debugging, comparing
backends, or a GPU machine where Triton compilation is too slow to wait for); the default
``auto`` picks the Triton kernels on CUDA.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch


def use_fla(device: torch.device | str) -> bool:
    """Whether the dispatchers may pick fla's kernels for tensors on ``device``."""
    choice = os.environ.get("K3TRAIN_KERNELS", "auto")
    if choice not in ("auto", "torch"):
        raise ValueError(f"K3TRAIN_KERNELS={choice!r}: allowed values are 'auto' (fla on CUDA) and 'torch'")
    return choice == "auto" and torch.device(device).type == "cuda"


@functools.cache
def _fla_function(module: str, name: str):
    # Imported lazily: fla pulls in Triton, which CPU-only installs do not have.
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError:
        return None
    from k3train.ops.triton_compile import configure_autotune

    configure_autotune()  # K3TRAIN_AUTOTUNE applies to fla's autotuners from their first use
    return fn


def fla_kernel(device: torch.device | str, module: str, name: str):
    """fla's ``module.name`` when the dispatchers may use fla on ``device`` and it imports, else None."""
    return _fla_function(module, name) if use_fla(device) else None
