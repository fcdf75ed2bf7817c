"""Transformer Engine as the fp8 backend (``precision.fp8_backend: te``, docs/quantization.md).

Inside the fp8 scope (``k3train.quant.recipes``) the linears become Transformer Engine
``Linear`` modules that hold **the same Parameter objects** as the layers they replace, so the
model's parameters, the optimizer's tables and every checkpoint tensor keep their names and
shapes:

* an ``nn.Linear`` (latent projections, shared experts) is replaced by a ``TELinear`` in its
  slot: its state-dict key stays ``<name>.weight``;
* a ``ColumnLinear`` / ``RowLinear`` (attention projections, ``parallel.tp == 1``, where its
  ``inner`` is ``k3train.ops.whole_linear.WholeLinear``, megatron-core's tp=1 linear in
  behaviour and keys) keeps its wrapper and gets a ``TELinear`` as its ``inner`` module: the
  key stays ``<name>.inner.weight``.

TE modules normally add an ``_extra_state`` entry per module to the state dict (the recipe and,
for DelayedScaling, the amax history and scales, pickled). ``TELinear`` carries none: its state
dict is exactly ``nn.Linear``'s, so a checkpoint written under the TE backend loads strictly
under torchao, bf16 or the MX recipes and the other way round. What that costs:
DelayedScaling's amax history is not checkpointed and starts again on resume (its first forward
after a resume scales with 1, as at the start of training).

The fp8 forward runs under TE's autocast (``te.autocast``, TE 2.x; 1.x called it
``fp8_autocast``) with the configured recipe:

* ``fp8_region(precision)`` gives the model chunk one region around each forward (one
  microbatch), as Megatron enters it around its transformer block: DelayedScaling reduces and
  updates every module's amax history once when the region exits, and once in backward;
* a ``TELinear`` called outside any region (an activation recompute in backward, an inference
  call that does not go through the chunk) enters a region of its own. Current and block
  scaling keep no state between calls, so that is exact; DelayedScaling with recompute is
  refused by the config (a recomputed forward would update the amax history a second time).

DelayedScaling is built with ``reduce_amax=False``: TE's default all-reduces the amaxes over the
default process group at every region exit, a collective inside the model that pipeline stages
reach at different times. Each rank keeps its own history (data-parallel ranks hold the same
weights; their activation amaxes differ by their batches).

Transformer Engine is imported here only inside functions (CPU machines and CI never have it).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from k3train.errors import UsageError

TE_INSTALL = 'pip install -e ".[te]" (Transformer Engine 2.x, CUDA machines; docs/dependencies.md#transformer-engine)'
# precision.fp8_recipe -> the TE recipe class it builds (transformer_engine.common.recipe).
TE_RECIPES = {"current": "Float8CurrentScaling", "delayed": "DelayedScaling", "blockwise": "Float8BlockScaling"}


def import_te():
    """``transformer_engine.pytorch``, or a one-line UsageError naming the install command.

    A TE found but not whole raises AssertionError or OSError at import, not ImportError
    (tools/te_device.sh saw both); every failure is reported the same way."""
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # noqa: BLE001 - see the docstring
        raise UsageError(f"precision.fp8_backend=te needs Transformer Engine: {TE_INSTALL}; importing it "
                         f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    return te


@functools.cache
def te_recipe(name: str):
    """The TE recipe object for ``precision.fp8_recipe`` ``name`` (current | delayed | blockwise);
    one per process, shared by the model's region and its modules (TE keys DelayedScaling's
    amax buffers by the recipe)."""
    if name not in TE_RECIPES:
        raise UsageError(f"precision.fp8_recipe={name!r} is not one of {', '.join(TE_RECIPES)}")
    import_te()
    from transformer_engine.common import recipe as te_recipes

    cls = getattr(te_recipes, TE_RECIPES[name])
    if name == "delayed":
        # No amax all-reduce inside the model (module docstring); TE's defaults otherwise
        # (history of 1024 steps, scale from its max, HYBRID: E4M3 forward, E5M2 gradients).
        return cls(reduce_amax=False)
    return cls()


def check_te(recipe_name: str) -> None:
    """Raise a one-line UsageError if Transformer Engine or this GPU cannot run ``recipe_name``."""
    te = import_te()
    ask = {"current": te.is_fp8_available, "delayed": te.is_fp8_available,
           "blockwise": te.is_fp8_block_scaling_available}[recipe_name]
    ok, reason = ask(return_reason=True)
    if not ok:
        raise UsageError(f"precision.fp8_recipe={recipe_name} ({TE_RECIPES[recipe_name]}) does not run here: "
                         f"{reason} Use another precision.fp8_recipe (docs/quantization.md#transformer-engine)")


def fits_fp8(shape: torch.Size | tuple[int, int]) -> bool:
    """Whether a weight ``[out, in]`` can run TE's (and torchao's) float8 GEMMs: both dims
    multiples of 16."""
    out_f, in_f = shape
    return out_f % 16 == 0 and in_f % 16 == 0


def checkpoint_key(local: str, module: nn.Module) -> str:
    """The state-dict key of the weight that the TE module replacing ``module`` (at ``local``)
    holds: ``<local>.weight`` for an ``nn.Linear`` (TELinear takes its slot), ``<local>.inner.weight``
    for a tensor-parallel linear (TELinear becomes its ``inner``). The same key the bf16 model
    saves, by construction; ``tests/quant/test_te_backend.py`` checks it on real state dicts."""
    return f"{local}.inner.weight" if hasattr(module, "inner") else f"{local}.weight"


@functools.cache
def te_linear_class():
    """``TELinear``: ``te.Linear`` without bias, sharing a given weight, with no ``_extra_state``
    (module docstring). Built on first use: it subclasses a Transformer Engine class."""
    te = import_te()
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    class TELinear(te.Linear):
        """``[..., in] -> [..., out]`` through TE's float8 GEMMs under ``te_recipe``; a call
        outside a TE region enters one; a call whose rows (the product of the leading dims) are
        not a multiple of 16 runs without float8 (TE's GEMMs need it; decode steps of one token)."""

        # nn.Module's own: no ``_extra_state`` key in the state dict, none expected on load.
        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            if rows % 16:
                with te.autocast(enabled=False, recipe=self.te_recipe):
                    return super().forward(x)
            if FP8GlobalStateManager.is_fp8_enabled():
                return super().forward(x)
            with te.autocast(enabled=True, recipe=self.te_recipe):
                return super().forward(x)

        def extra_repr(self) -> str:
            return (f"in_features={self.in_features}, out_features={self.out_features}, "
                    f"recipe={type(self.te_recipe).__name__}")

    return TELinear


@functools.cache
def te_inner_class():
    """``TEInnerLinear``: a ``TELinear`` in the place of a megatron-core parallel linear, the
    ``inner`` of a ``ColumnLinear``/``RowLinear``: it returns megatron's ``(out, None)`` and keeps
    megatron's ``_extra_state`` entry (always None, ignored on load), so the wrapper's state
    dict is the bf16 one key for key."""

    class TEInnerLinear(te_linear_class()):
        def forward(self, x: torch.Tensor):
            return super().forward(x), None

        def get_extra_state(self) -> None:
            return None

        def set_extra_state(self, state) -> None:
            pass

    return TEInnerLinear


def is_te_linear(module) -> bool:
    """Whether ``module`` is a ``TELinear`` (False, without importing TE, before one was built)."""
    return te_linear_class.cache_info().currsize > 0 and isinstance(module, te_linear_class())


def replaced_linear(module) -> bool:
    """Whether ``module`` is a ``TELinear`` in the slot of an ``nn.Linear`` (a scope leaf, as the
    nn.Linear was), not the ``inner`` of a tensor-parallel linear."""
    return is_te_linear(module) and not isinstance(module, te_inner_class())


def te_linear(weight: nn.Parameter, recipe, *, inner: bool = False) -> nn.Module:
    """A ``TELinear`` (``inner``: a ``TEInnerLinear``) whose weight IS ``weight`` (``[out, in]``,
    the same Parameter object: optimizer tables, tensor-parallel attributes and state-dict
    tensors are unchanged)."""
    out_f, in_f = weight.shape
    cls = te_inner_class() if inner else te_linear_class()
    # Built on the meta device: its own weight is never allocated, the shared one replaces it.
    lin = cls(in_f, out_f, bias=False, params_dtype=weight.dtype, device="meta")
    lin._parameters["weight"] = weight
    lin.te_recipe = recipe
    return lin


def fp8_region(recipe_name: str):
    """A zero-argument factory of TE's autocast context with ``recipe_name``'s recipe
    (``te_recipe``: the object the modules hold too)."""
    te, recipe = import_te(), te_recipe(recipe_name)
    return lambda: te.autocast(enabled=True, recipe=recipe)
