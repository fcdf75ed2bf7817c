"""The kernel choices ``optim`` runs with: one frozen ``Backends`` value, set once per run.

``optim`` never imports ``k3train``; the run's kernel registry (``k3train.ops.kernels.apply``)
builds a ``Backends`` from the resolved ``kernels:`` section and hands it over with
``set_backends``. Until then the defaults hold (ours on CUDA). Nothing reads the environment.
"""
from __future__ import annotations

import dataclasses

KERNELS = ("k3train", "torch")


@dataclasses.dataclass(frozen=True)
class Backends:
    """Muon's CUDA backends, each ``"k3train"`` (our Triton kernel) or ``"torch"``:
    ``momentum``, the momentum + Nesterov pass (``optim/momentum_triton.py``, or two torch adds),
    and ``ns_gemm``, Newton-Schulz's ``beta * C + alpha * A @ B`` (``optim/ns_gemm_triton.py``,
    or ``torch.baddbmm``). CPU tensors always take the torch path."""

    momentum: str = "k3train"
    ns_gemm: str = "k3train"

    def __post_init__(self):
        for name in ("momentum", "ns_gemm"):
            if getattr(self, name) not in KERNELS:
                raise ValueError(f"optim.backends.{name}={getattr(self, name)!r}: allowed values are "
                                 f"{', '.join(KERNELS)}")


_CURRENT = [Backends()]


def set_backends(backends: Backends) -> None:
    """Make ``backends`` the choices in force (called by the run's kernel registry)."""
    if not isinstance(backends, Backends):
        raise TypeError(f"optim.backends.set_backends takes a Backends, not {type(backends).__name__}")
    _CURRENT[0] = backends


def current() -> Backends:
    """The choices in force."""
    return _CURRENT[0]
