"""torchao's float8 training matmul as the ``quant`` hook of k3train's megatron-core linears.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules only, and the attention
projections (KDA q/k/v/g/o, MLA q_up/kv_up/gate/o) are ``ColumnLinear``/``RowLinear`` around
megatron-core's parallel linears, so fp8 as first shipped left the largest GEMMs of a layer in
bf16 (issue 22). At ``parallel.tp == 1`` those linears compute the plain product
``x @ W^T`` (``k3train.model.common``: their ``quant`` hook replaces the matmul), so the same
autograd function torchao's ``Float8Linear.forward`` calls can take that product: the forward
GEMM and both backward GEMMs (grad input, grad weight) run in float8 with the scaling of the
run's ``Float8LinearConfig``, exactly as for a converted ``nn.Linear``.

``matmul_with_hp_or_float8_args`` is torchao-internal (stable from 0.10 to 0.18, the range the
``gpu`` extra allows); an import failure is reported as a usage error naming torchao.
"""
from __future__ import annotations

import torch

from k3train.errors import UsageError


class Float8Matmul:
    """``(x [..., in], weight [out, in]) -> [..., out]`` in float8 (torchao's training matmul).

    config: a ``torchao.float8.Float8LinearConfig`` (``emulate=True`` runs it on CPU with the
    float8 rounding emulated, for tests). Not an ``nn.Module``: it holds no parameters, so a
    linear using it keeps its state dict."""

    def __init__(self, *, config):
        try:
            from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
        except ImportError as exc:
            raise UsageError(f"precision.recipe=fp8 on tensor-parallel linears needs torchao's float8 "
                             f"training matmul (torchao 0.10-0.18, pip install -e \".[gpu]\"): {exc}") from None
        self._apply = matmul_with_hp_or_float8_args.apply
        # The GEMM settings (fast accumulation, padding, emulation) as Float8Linear derives them
        # from the config; the shell's sizes do not enter them, and meta allocates nothing.
        with torch.device("meta"):
            shell = Float8Linear(16, 16, bias=False, config=config)
        self.config, self.mm_config = shell.config, shell.linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As Float8Linear.forward: under autocast the input enters in the autocast dtype, so the
        # output (and its gradient) has the dtype a bf16 linear would give.
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            x = x.to(torch.get_autocast_dtype(dev))
        return self._apply(x, weight.t(), self.mm_config, self.config)

    def __repr__(self) -> str:
        return f"Float8Matmul({self.config.cast_config_input.short_str()})"
