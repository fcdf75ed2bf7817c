"""Low-precision (bf16) model weights stepped through fp32 main parameters, replicated over data
parallelism (the ZeRO-1 form is ``ShardedOptimizer(param_dtype=...)``).

Layout per parameter ``p`` (``[*shape]``), megatron-core's mixed-precision optimizer:

* ``p`` itself: the weight the model computes with, in ``param_dtype`` (bf16: 2 bytes).
* ``p.main_grad``: fp32 gradient accumulated over the step's microbatches (``MainGrads``, 4 B).
* the main parameter: an fp32 copy (4 B) the optimizer steps, taken from ``p`` before it is
  cast down (so an fp32 initialisation survives whole), whose ``.grad`` is ``p.main_grad``.
* the optimizer's state on the main parameter: AdamW moments or Muon momentum in
  ``state_dtype`` (fp32 or bf16).

A step reduces the fp32 main gradients (``optim.grads.DataParallelGrads``), norms and clips
them, runs the inner optimizer (``build_optimizer``: the same AdamW / Muon / DistributedMuon an
fp32 model uses) on the main parameters, then copies them into the weights, rounding to
``param_dtype``. Given the same gradients the main parameters follow exactly the trajectory
the fp32 weights of the plain optimizer follow (tests/optim/test_main_params.py).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from .build import build_optimizer
from .grads import DataParallelGrads, GradGroups
from .main_grads import MainGrads
from .param_table import ParamEntry

__all__ = ["MainParamOptimizer", "cast_params_"]

# The attributes megatron-core (and our tensor-parallel layers) hang on a weight that the norm
# and the checkpoint pieces read: kept on the main parameter too.
_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")


def cast_params_(params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
    """Cast parameters in place to ``dtype`` (``p.data`` replaced: the Parameter objects, their
    hooks and attributes stay, so modules and optimizers keep referring to them)."""
    with torch.no_grad():
        for p in params:
            if p.dtype != dtype:
                p.data = p.data.to(dtype)


def _main_copy(p: torch.Tensor) -> torch.Tensor:
    """``p``'s values as a new fp32 tensor. An fp32 ``p`` hands over its own storage (``p.data``:
    a fresh version counter, so stepping it never trips autograd's checks on ``p``), which
    ``cast_params_`` then replaces in ``p`` by a bf16 copy: 6 bytes per parameter at set-up, not 10."""
    main = p.data if p.dtype == torch.float32 else p.detach().to(torch.float32)
    for attr in _TP_ATTRS:
        if hasattr(p, attr):
            setattr(main, attr, getattr(p, attr))
    return main


class MainParamOptimizer:
    """bf16 weights, fp32 main parameters and gradients, the optimizer replicated over DP.

    table: the model's parameter table (``ParamEntry.param`` are the model's parameters, still
    at their initial precision: their values become the fp32 main parameters, then they are
    cast to ``param_dtype``). Keywords: ``param_dtype`` (the weights' dtype), ``name``,
    ``groups`` and ``expert_params`` (as ``DataParallelGrads``), ``state_dtype`` (None: fp32),
    ``muon_group_of`` (given the *model* parameter: ``build_optimizer``'s) and
    ``build_optimizer``'s hyper-parameters. Same surface as ``ShardedOptimizer``: it reduces the
    gradients itself (``reduces_gradients``), ``reduce_grads`` / ``global_grad_norm`` /
    ``clip_grads_`` / ``step`` / ``zero_grad`` / ``state_dict``.
    """

    reduces_gradients = True

    def __init__(self, table: list[ParamEntry], *, param_dtype: torch.dtype, name: str = "adamw",
                 groups: GradGroups = GradGroups(), expert_params=(),
                 state_dtype: torch.dtype | None = None,
                 muon_group_of: Callable[[torch.Tensor], Any] | None = None, **hyper) -> None:
        self.params = [e.param for e in table]
        self.mains = [_main_copy(p) for p in self.params]
        self._model_of = {id(m): p for m, p in zip(self.mains, self.params)}
        main_table = [replace(e, param=m) for e, m in zip(table, self.mains)]
        group_of = None
        if muon_group_of is not None:
            def group_of(main: torch.Tensor):
                return muon_group_of(self._model_of[id(main)])
        self.inner = build_optimizer(main_table, name, muon_group_of=group_of,
                                     state_dtype=state_dtype or torch.float32, **hyper)
        experts = {id(p) for p in expert_params}
        self.grads = DataParallelGrads(self.mains, groups=groups,
                                       expert_params=[m for m, p in zip(self.mains, self.params)
                                                      if id(p) in experts])
        cast_params_(self.params, param_dtype)
        self.main_grads = MainGrads(params=self.params)

    # ---- the surface the trainer drives -------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (their ``params`` are the fp32 main parameters)."""
        return self.inner.param_groups

    @property
    def optimizers(self):
        return self.inner.optimizers

    def model_param(self, main: torch.Tensor) -> torch.nn.Parameter:
        """The model weight whose main parameter is ``main``."""
        return self._model_of[id(main)]

    def main_params(self) -> dict[int, torch.Tensor]:
        """{id(model parameter): its fp32 main parameter ``[*p.shape]``}."""
        return {id(p): m for p, m in zip(self.params, self.mains)}

    @torch.no_grad()
    def load_main_params(self, values: dict[int, torch.Tensor]) -> None:
        """Set main parameters (and the weights, rounded) from ``{id(model parameter): value}``;
        parameters without an entry keep theirs."""
        for p, m in zip(self.params, self.mains):
            if id(p) in values:
                m.copy_(values[id(p)])
                p.copy_(m)

    def _link(self) -> None:
        for p, m in zip(self.params, self.mains):
            m.grad = p.main_grad  # None where no backward reached p (the optimizer skips it)

    def reduce_grads(self) -> None:
        self._link()
        self.grads.reduce_grads()

    def global_grad_norm(self) -> torch.Tensor:
        self._link()
        return self.grads.global_grad_norm()

    def clip_grads_(self, norm: torch.Tensor, max_norm: float | None) -> None:
        self._link()
        self.grads.clip_grads_(norm, max_norm)

    @torch.no_grad()
    def step(self) -> None:
        """Step the main parameters, then round them into the weights."""
        self._link()
        self.inner.step()
        torch._foreach_copy_(self.params, self.mains)

    def warm_kernels(self) -> None:
        self._link()  # Muon warms the parameters that have a gradient
        self.inner.warm_kernels()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients (the fp32 buffers stay allocated for the next step)."""
        self.main_grads.clear()
        for m in self.mains:
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "main_params": [m.clone() for m in self.mains]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        for p, m, saved in zip(self.params, self.mains, state["main_params"]):
            m.copy_(saved)
            p.copy_(m)

    def __repr__(self) -> str:
        return f"MainParamOptimizer({self.inner!r})"
