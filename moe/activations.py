"""SiTU and SiTU-GLU activations of the K3 experts (docs/architecture.md#situ-glu-moeactivationspy).

SiTU(g) = beta * tanh(g / beta) * sigmoid(g) behaves like SiLU near zero but saturates at
``beta`` for large g, and the GLU's up branch is soft-capped at ``beta_lin``: both bound the
activations so that low-precision (MXFP8) activation quantisation has a fixed range.
"""
from __future__ import annotations

import torch

from .compile import compile_on_cuda

DEFAULT_BETA = 4.0
DEFAULT_BETA_LIN = 25.0


def situ(g: torch.Tensor, beta: float = DEFAULT_BETA) -> torch.Tensor:
    """SiTU(g) = beta * tanh(g / beta) * sigmoid(g), elementwise; same shape and dtype as g."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def situ_glu_eager(gate: torch.Tensor, up: torch.Tensor, beta: float = DEFAULT_BETA,
                   beta_lin: float = DEFAULT_BETA_LIN) -> torch.Tensor:
    """SiTU(gate) * beta_lin * tanh(up / beta_lin), op by op.

    gate, up: ``[..., F]`` (same shape) -> ``[..., F]``.
    """
    return situ(gate, beta) * (beta_lin * torch.tanh(up / beta_lin))


# Eager, this is 9 elementwise kernels forward and about 15 backward, each a full pass over
# [tokens, F], about a tenth of a dense model's step (measured: see
# benchmarks/README.md). Compiled: one kernel each way. dynamic=None lets torch recompile once for varying row
# counts (expert batches under expert parallelism) and then stay dynamic. Outside autocast:
# tanh, sigmoid and products are not autocast ops (each keeps its input's dtype either way),
# so that changes no result and keeps autocast state from being a recompile guard.
_situ_glu = compile_on_cuda(situ_glu_eager, fullgraph=True, outside_autocast=True)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = DEFAULT_BETA,
             beta_lin: float = DEFAULT_BETA_LIN) -> torch.Tensor:
    """SiTU(gate) * beta_lin * tanh(up / beta_lin): ``situ_glu_eager``, compiled into one kernel
    on CUDA (``kernels.compile=false`` turns that off). gate, up: ``[..., F]`` -> ``[..., F]``."""
    return _situ_glu(gate, up, beta, beta_lin)
