"""The kernel choices ``k3train.ops`` runs with: one frozen ``Backends`` value, set once per run.

The same delivery as ``moe.backends`` and ``optim.backends``: the run's kernel registry
(``k3train.ops.kernels.apply``) resolves the ``kernels:`` section once and hands each package
its frozen part with ``set_backends``; the ops read ``current()`` and nothing reads the
environment per call. This module imports nothing of the project, so ``triton_compile`` can read
the autotune settings without importing the registry (which imports it).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Backends:
    """``kda``, ``attnres``, ``short_conv``: each family's CUDA backend (``fla``, ``k3train`` or
    ``torch``; off CUDA every op takes torch); ``compile``: whether CUDA calls of the small fused
    pieces go through ``torch.compile``; ``autotune`` (``full``/``fixed``),
    ``autotune_bench_ms`` and ``autotune_picks``: the Triton autotuning settings."""

    kda: str = "torch"
    attnres: str = "torch"
    short_conv: str = "torch"
    compile: bool = False
    autotune: str = "full"
    autotune_bench_ms: float = 25.0
    autotune_picks: str = "auto"

    def backend(self, family: str, device_type: str) -> str:
        """``family``'s backend for tensors on a ``device_type`` device."""
        return getattr(self, family) if device_type == "cuda" else "torch"


_CURRENT = [Backends()]


def set_backends(backends: Backends) -> None:
    """Make ``backends`` the choices in force (called by the run's kernel registry)."""
    _CURRENT[0] = backends


def current() -> Backends:
    """The choices in force."""
    return _CURRENT[0]
