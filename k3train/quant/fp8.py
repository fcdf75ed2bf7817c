"""torchao's float8 training matmul as the ``quant`` hook of k3train's megatron-core linears.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules only, and the attention
projections (KDA q/k/v/g/o, MLA q_up/kv_up/gate/o) are ``ColumnLinear``/``RowLinear`` around
megatron-core's parallel linears, so fp8 as first shipped left the largest GEMMs of a layer in
bf16. At ``parallel.tp == 1`` those linears compute the plain product
``x @ W^T`` (``k3train.ops.layers``: their ``quant`` hook replaces the matmul), so the same
autograd function torchao's ``Float8Linear.forward`` calls can take that product: the forward
GEMM and both backward GEMMs (grad input, grad weight) run in float8 with the scaling of the
run's ``Float8LinearConfig``, exactly as for a converted ``nn.Linear``.

``matmul_with_hp_or_float8_args`` is torchao-internal (stable from 0.10 to 0.18, the range the
``gpu`` extra allows); an import failure is reported as a usage error naming torchao.

Every float8 linear (these hooks and the ``nn.Linear`` modules torchao converts) runs its
product through :func:`float8_matmul`, which goes through ``torch.compile`` on CUDA when the
fused pieces do (``kernels.compile``). Run eagerly, torchao's dynamic scaling is a string of
separate kernels per GEMM operand (absolute value, max, scale, clamp, cast), enough to make fp8
slower than bf16 at the K3 slice's widths (benchmarks/README.md, "FP8 at the K3 slice's
widths", and its dated result file). Compiled, Inductor fuses them into a few kernels; torchao's float8
speed-ups are stated for that mode. ``dynamic=True``: one graph serves every linear's shapes.
"""
from __future__ import annotations

import functools

import torch

from k3train.errors import UsageError
from moe.compile import compile_on_cuda


def _float8_matmul_eager(x: torch.Tensor, weight_t: torch.Tensor, mm_config, config) -> torch.Tensor:
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return matmul_with_hp_or_float8_args.apply(x, weight_t, mm_config, config)


# Every cast inside is explicit (the output takes x's dtype), so autocast is not a guard.
float8_matmul = compile_on_cuda(_float8_matmul_eager, dynamic=True, outside_autocast=True)
float8_matmul.__doc__ = """``(x [..., in], weight_t [in, out], mm_config, config) -> [..., out]``
in x's dtype: torchao's float8 training matmul, compiled on CUDA when ``kernels.compile`` is on."""


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    # As Float8Linear.forward: under autocast the input enters in the autocast dtype, so the
    # output (and its gradient) has the dtype a bf16 linear would give.
    dev = x.device.type
    return x.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else x


@functools.cache
def float8_linear_class():
    """A subclass of torchao's ``Float8Linear`` (same parameters, same state dict) whose forward
    goes through :func:`float8_matmul`; ``k3train.quant.recipes`` gives it to the modules
    ``convert_to_float8_training`` made."""
    from torchao.float8.float8_linear import Float8Linear

    class CompiledFloat8Linear(Float8Linear):
        """``[..., in] -> [..., out]``: torchao's Float8Linear with its product through
        ``float8_matmul`` (compiled on CUDA, see k3train.quant.fp8)."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            out = float8_matmul(_autocast_input(input), self.weight.t(), self.linear_mm_config, self.config)
            return out if self.bias is None else out + self.bias.to(out.dtype)

    return CompiledFloat8Linear


class Float8Matmul:
    """``(x [..., in], weight [out, in]) -> [..., out]`` in float8 (torchao's training matmul).

    config: a ``torchao.float8.Float8LinearConfig`` (``emulate=True`` runs it on CPU with the
    float8 rounding emulated, for tests). Not an ``nn.Module``: it holds no parameters, so a
    linear using it keeps its state dict."""

    def __init__(self, *, config):
        try:
            from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"precision.recipe=fp8 on tensor-parallel linears needs torchao's float8 "
                             f"training matmul (torchao 0.10-0.18, pip install -e \".[gpu]\"): {exc}") from None
        # The GEMM settings (fast accumulation, padding, emulation) as Float8Linear derives them
        # from the config; the shell's sizes do not enter them, and meta allocates nothing.
        with torch.device("meta"):
            shell = Float8Linear(16, 16, bias=False, config=config)
        self.config, self.mm_config = shell.config, shell.linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return float8_matmul(_autocast_input(x), weight.t(), self.mm_config, self.config)

    def __repr__(self) -> str:
        return f"Float8Matmul({self.config.cast_config_input.short_str()})"
