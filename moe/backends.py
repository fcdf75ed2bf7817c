"""The kernel choices ``moe`` runs with: one frozen ``Backends`` value, set once per run.

``moe`` never imports ``k3train``; the run's kernel registry (``k3train.ops.kernels.apply``)
builds a ``Backends`` from the resolved ``kernels:`` section and hands it over with
``set_backends``. Until then the defaults hold (ours on CUDA, compile on). The ops read
``current()``; nothing reads the environment.

Beside each Triton backend its op keeps a verifier (``verify(...)``: do these shapes and
dtypes fit the kernel?) so the op itself asks one question: ``use_kernel``.
"""
from __future__ import annotations

import dataclasses

KERNELS = ("k3train", "torch")


@dataclasses.dataclass(frozen=True)
class Backends:
    """``router_topk``, ``moe_permute``: the CUDA backend of each family, ``"k3train"`` (our
    Triton kernel) or ``"torch"``; ``compile``: whether CUDA calls of the small fused pieces go
    through ``torch.compile`` (``moe.compile``). CPU tensors always take the torch path."""

    router_topk: str = "k3train"
    moe_permute: str = "k3train"
    compile: bool = True

    def __post_init__(self):
        for name in ("router_topk", "moe_permute"):
            if getattr(self, name) not in KERNELS:
                raise ValueError(f"moe.backends.{name}={getattr(self, name)!r}: allowed values are "
                                 f"{', '.join(KERNELS)}")


_CURRENT = [Backends()]


def set_backends(backends: Backends) -> None:
    """Make ``backends`` the choices in force (called by the run's kernel registry)."""
    if not isinstance(backends, Backends):
        raise TypeError(f"moe.backends.set_backends takes a Backends, not {type(backends).__name__}")
    _CURRENT[0] = backends


def current() -> Backends:
    """The choices in force."""
    return _CURRENT[0]
