"""Precision recipes (docs/quantization.md#recipes-precisionrecipe): which modules a recipe quantises, and how.

``apply_precision`` runs at model build time (``K3Chunk.__init__``), so a layer is quantised
from its first forward and the trainer needs no extra call. It hands each in-scope layer its
quantisation hook, the configuration its constructor also accepts:
  * ``GroupedExperts``: ``weight_quant`` / ``act_quant`` (``QuantSpec`` methods);
  * ``nn.Linear``: replaced by ``MXLinear`` sharing the same Parameters;
  * ``ColumnLinear`` / ``RowLinear`` (the TP linears; megatron-core's at tp > 1): ``quant = spec.linear``, valid at
    ``parallel.tp == 1`` only (the fake-quantised product is the unsharded one); tp > 1 is refused.
fp8 converts in-scope ``nn.Linear`` modules with torchao's ``convert_to_float8_training`` and
gives in-scope ``ColumnLinear`` / ``RowLinear`` (tp == 1) torchao's float8 matmul as their
``quant`` hook (``k3train.quant.fp8``), and in-scope ``GroupedExperts`` the FP8 grouped GEMM as
their ``grouped_gemm`` hook (``k3train.quant.fp8_grouped``: torchao's rowwise-scaled grouped
GEMM on CUDA, its exact emulation under ``Float8LinearConfig(emulate=True)``).
``precision.fp8_backend=te`` instead gives the same linears Transformer Engine linears sharing
their weights (``k3train.quant.te_backend``), and ``fp8_region`` TE's autocast for the model's
forward; the routed experts keep the grouped GEMM hook under either backend.

Scope names use global layer indices (``layers.<i>.``) even inside a pipeline chunk, so a
pattern means the same layers whatever the pipeline split.
"""
from __future__ import annotations

import contextlib
import re

import torch
import torch.nn as nn

from k3train.config.schema import PrecisionConfig
from k3train.errors import UsageError
from k3train.ops.layers import ColumnLinear, RowLinear, tp_size
from k3train.quant.fp8 import Float8Matmul, float8_linear_class
from k3train.quant import te_backend
from k3train.quant.fp8_grouped import Fp8GroupedGemm
from k3train.quant.spec import MX_SPECS, MXLinear, QuantSpec
from k3train.runtime import device as runtime_device
from moe import GroupedExperts

DEFAULT_SCOPES = {
    "mxfp4_qat": [r"\.ffn\.experts$"],  # K3 quantises the routed experts only
    "mxfp8": [r"\.ffn\.experts$"],
    # The large GEMMs outside the routed experts: latent projections, shared experts and the
    # attention projections (KDA q/k/v/g/o, MLA q/kv down and up, gate, o). Not KDA's
    # low-rank forget-gate pair (rank 128) or beta projection (one column per head): GEMMs that
    # thin lose more to the casts than float8 saves.
    # The routed experts join under precision.fp8_experts (FP8_EXPERTS_SCOPE); never the router,
    # which select_scope never selects.
    "fp8": [r"\.ffn\.(down|up)$", r"\.ffn\.shared$", r"\.mixer\.(q|k|v|g|o|gate)_proj$",
            r"\.mixer\.(q|kv)_(down|up)$"],
}
# The routed experts' three grouped GEMMs in FP8 (k3train.quant.fp8_grouped), added to fp8's
# default scope by precision.fp8_experts: off by default until the CUDA kernel path has run on an
# H200 against its emulation (scripts/gpu_check_fp8_experts.py; CPU-tested only so far).
FP8_EXPERTS_SCOPE = r"\.ffn\.experts$"
_LEAVES = (GroupedExperts, nn.Linear, ColumnLinear, RowLinear)
_FP8_INSTALL = ('precision.recipe=fp8 needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper) '
                'and its backend (torchao: pip install -e ".[gpu]"; te: pip install -e ".[te]")')


def resolve_device(choice: str | torch.device) -> torch.device:
    """``train.device`` or a device -> torch.device (``k3train.runtime.device.resolve_device``,
    without its availability check: a CUDA config builds on the meta device on any machine)."""
    return runtime_device.resolve_device(choice, check_available=False)


def scope_patterns(precision: PrecisionConfig) -> list[str]:
    """The module patterns ``precision`` quantises: its ``scope``, else the recipe's default
    (fp8's with the routed experts under ``fp8_experts``)."""
    if precision.scope is not None:
        return list(precision.scope)
    extra = [FP8_EXPERTS_SCOPE] if precision.recipe == "fp8" and precision.fp8_experts else []
    return [*DEFAULT_SCOPES.get(precision.recipe, []), *extra]


def _torchao_importable() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def validate_precision(precision: PrecisionConfig, device: str | torch.device) -> None:
    """Raise a one-line UsageError if the recipe cannot run on ``device`` with its backend."""
    if precision.recipe != "fp8":
        return
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise UsageError(f"{_FP8_INSTALL}; this run is on {dev.type}. On CPU use precision.recipe="
                         f"bf16, mxfp8 or mxfp4_qat (MX is emulated exactly)")
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        raise UsageError(f"{_FP8_INSTALL}; this GPU has compute capability {cap[0]}.{cap[1]}")
    if precision.fp8_backend == "te":
        te_backend.check_te(precision.fp8_recipe)
    elif not _torchao_importable():
        raise UsageError(f"{_FP8_INSTALL}; torchao is not importable (or set precision.fp8_backend=te "
                         f"with Transformer Engine: {te_backend.TE_INSTALL})")


def _global_name(name: str, layer_offset: int) -> str:
    """Chunk-local ``layers.<i>...`` -> ``layers.<i + layer_offset>...``."""
    if not layer_offset:
        return name
    return re.sub(r"^layers\.(\d+)", lambda m: f"layers.{int(m.group(1)) + layer_offset}", name)


def select_scope(model: nn.Module, patterns: list[str], layer_offset: int = 0,
                 require_match: bool = True) -> dict[str, str]:
    """Quantisable modules the patterns select: {global name: local name}, in model order.

    A pattern matching a quantisable module selects it; matching a container selects the
    quantisable modules inside it. Routers are never selected (they are not linears). Raises
    ValueError naming a pattern that selects nothing, when ``require_match``.
    """
    local_of = {_global_name(n, layer_offset): n for n, _ in model.named_modules()}
    modules = dict(model.named_modules())
    leaves = [g for g, n in local_of.items()
              if isinstance(modules[n], _LEAVES) or te_backend.replaced_linear(modules[n])]
    chosen: set[str] = set()
    for pattern in patterns:
        rx = re.compile(pattern)
        hits = [g for g in local_of if g and rx.search(g)]
        picked = {leaf for leaf in leaves for h in hits if leaf == h or leaf.startswith(h + ".")}
        if require_match and not picked:
            shown = f"it matches only {hits[:3]}, which hold no linear or expert weights" if hits else \
                "no module name matches it"
            raise UsageError(f"precision.scope pattern {pattern!r} selects nothing: {shown} "
                             f"(names look like 'layers.1.ffn.experts'; see docs/quantization.md)")
        chosen |= picked
    # Leaves never nest (a TP linear's inner megatron or TE module is not a leaf).
    return {g: local_of[g] for g in local_of if g in chosen}


def _set_child(model: nn.Module, local: str, new: nn.Module) -> None:
    parent, _, attr = local.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _check_blocks(name: str, dims: dict[str, int], block: int) -> None:
    for what, size in dims.items():
        if size % block:
            raise UsageError(f"cannot MX-quantise {name}: its {what} ({size}) is not a multiple of the "
                             f"block size {block}; change the width or drop it from precision.scope")


def _apply_mx(model: nn.Module, name: str, local: str, spec: QuantSpec) -> None:
    mod = model.get_submodule(local)
    bs = spec.block_size
    if isinstance(mod, GroupedExperts):
        _check_blocks(name, {"in size": mod.in_size, "ffn size": mod.ffn_size}, bs)
        mod.weight_quant, mod.act_quant = spec.grouped_weight, spec.activation
    elif isinstance(mod, (ColumnLinear, RowLinear)):
        if tp_size() > 1:
            raise UsageError(f"precision.scope selects {name}, a tensor-parallel linear; MX recipes support "
                             f"those at parallel.tp=1 only (tp is {tp_size()})")
        _check_blocks(name, {"input features": mod.weight.shape[1]}, bs)
        mod.quant = spec.linear
    else:
        _check_blocks(name, {"input features": mod.in_features}, bs)
        _set_child(model, local, MXLinear.from_linear(mod, spec))


def fp8_linear_config(emulate: bool = False):
    """torchao's tensorwise (``precision.fp8_recipe=current``) float8 config; ``emulate``: float8
    rounding emulated in high precision (CPU tests)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    return dataclasses.replace(config, emulate=True) if emulate else config


def _apply_fp8(model: nn.Module, targets: dict[str, str], config=None, *, skip_unfit: bool = False) -> list[str]:
    """Float8 on ``targets``; returns the names converted. ``config``: a ``Float8LinearConfig``
    (default ``fp8_linear_config()``). ``skip_unfit``: leave out linears whose dims are not
    multiples of 16 instead of refusing (the default scope on a small model; an explicit
    ``precision.scope`` naming one is an error)."""
    from torchao.float8 import convert_to_float8_training

    from torchao.float8.float8_linear import Float8Linear

    config = config if config is not None else fp8_linear_config()
    linears, done = set(), []
    for name, local in targets.items():
        mod = model.get_submodule(local)
        if isinstance(mod, Float8Linear) or isinstance(getattr(mod, "quant", None), Float8Matmul):
            done.append(name)
            continue
        if isinstance(mod, GroupedExperts):
            if isinstance(mod.grouped_gemm, Fp8GroupedGemm):
                done.append(name)
                continue
            if (mod.in_size % 16 or mod.ffn_size % 16) and skip_unfit:
                continue
            if mod.in_size % 16 or mod.ffn_size % 16:
                raise UsageError(f"fp8 grouped GEMMs need the expert widths of {name} to be multiples of "
                                 f"16; got in {mod.in_size}, ffn {mod.ffn_size}")
            mod.grouped_gemm = Fp8GroupedGemm(emulate=config.emulate)
            done.append(name)
            continue
        out_f, in_f = mod.weight.shape
        if (in_f % 16 or out_f % 16) and skip_unfit:
            continue
        if in_f % 16 or out_f % 16:
            raise UsageError(f"fp8 GEMMs need both dims of {name} to be multiples of 16; got {in_f}x{out_f}")
        if isinstance(mod, (ColumnLinear, RowLinear)):
            if tp_size() > 1:
                raise UsageError(f"precision.scope selects {name}, a tensor-parallel linear; fp8 "
                                 f"supports those at parallel.tp=1 only (tp is {tp_size()})")
            mod.quant = Float8Matmul(config=config)
        elif type(mod) is nn.Linear:
            linears.add(local)
        else:
            raise UsageError(f"precision.recipe=fp8 converts nn.Linear and tensor-parallel linears; "
                             f"precision.scope selects {name}, a {type(mod).__name__}")
        done.append(name)
    if linears:
        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in linears, config=config)
        for local in linears:
            # The same parameters and state; only the forward changes (through float8_matmul).
            model.get_submodule(local).__class__ = float8_linear_class()
    return done


def te_targets(model: nn.Module, targets: dict[str, str], *, skip_unfit: bool = False) -> dict[str, str]:
    """The in-scope linears the TE backend replaces: ``{global name: checkpoint key of its
    weight}`` (``te_backend.checkpoint_key``), in model order; the same modules, and the same
    widths left out under ``skip_unfit``, as ``_apply_fp8`` converts. Routed experts are not
    TE's (see ``_apply_te``). Raises, as ``_apply_fp8``, for an unfit or tensor-parallel linear
    an explicit scope names, and for a module kind TE does not replace."""
    out = {}
    for name, local in targets.items():
        mod = model.get_submodule(local)
        if isinstance(mod, GroupedExperts):
            continue
        if te_backend.is_te_linear(mod):
            out[name] = te_backend.checkpoint_key(local, mod)   # applied already (idempotent)
            continue
        if not isinstance(mod, (ColumnLinear, RowLinear)) and type(mod) is not nn.Linear:
            raise UsageError(f"precision.fp8_backend=te replaces nn.Linear and tensor-parallel linears; "
                             f"precision.scope selects {name}, a {type(mod).__name__}")
        if not te_backend.fits_fp8(mod.weight.shape):
            if skip_unfit:
                continue
            raise UsageError(f"fp8 GEMMs need both dims of {name} to be multiples of 16; got "
                             f"{mod.weight.shape[1]}x{mod.weight.shape[0]}")
        if isinstance(mod, (ColumnLinear, RowLinear)) and tp_size() > 1:
            raise UsageError(f"precision.scope selects {name}, a tensor-parallel linear; fp8 "
                             f"supports those at parallel.tp=1 only (tp is {tp_size()})")
        if getattr(mod, "bias", None) is not None:
            raise UsageError(f"precision.fp8_backend=te replaces bias-free linears; {name} has a bias")
        out[name] = te_backend.checkpoint_key(local, mod)
    return out


def _apply_te(model: nn.Module, targets: dict[str, str], recipe_name: str, *, skip_unfit: bool = False) -> list[str]:
    """Transformer Engine linears on ``targets`` (``te_targets``), sharing their weights;
    returns the names converted. Routed experts in the scope go to torchao's grouped path
    (``_apply_fp8``): TE's ``GroupedLinear`` is not wired in (docs/quantization.md)."""
    experts = {n: loc for n, loc in targets.items() if isinstance(model.get_submodule(loc), GroupedExperts)}
    done = _apply_fp8(model, experts, skip_unfit=skip_unfit) if experts else []
    recipe = te_backend.te_recipe(recipe_name)
    for name in te_targets(model, targets, skip_unfit=skip_unfit):
        local = targets[name]
        mod = model.get_submodule(local)
        if te_backend.is_te_linear(mod) or te_backend.is_te_linear(getattr(mod, "inner", None)):
            pass   # applied already
        elif isinstance(mod, (ColumnLinear, RowLinear)):
            mod.quant = None
            mod.inner = te_backend.te_linear(mod.inner.weight, recipe, inner=True)
        else:
            _set_child(model, local, te_backend.te_linear(mod.weight, recipe))
        done.append(name)
    return [n for n in targets if n in set(done)]


def fp8_region(precision: PrecisionConfig):
    """A zero-argument factory of the context the model's forward runs in: TE's autocast with
    ``precision.fp8_recipe`` under ``recipe=fp8, fp8_backend=te`` (``te_backend.fp8_region``),
    else ``contextlib.nullcontext``."""
    if precision.recipe == "fp8" and precision.fp8_backend == "te":
        return te_backend.fp8_region(precision.fp8_recipe)
    return contextlib.nullcontext


def fp8_gemm_shapes(model: nn.Module, precision: PrecisionConfig) -> dict[tuple[int, int], int]:
    """The linear GEMMs ``precision.recipe=fp8`` runs in float8 on ``model``: ``{(in_features,
    out_features): how many modules}`` (the routed experts' grouped GEMMs are not linears and
    are not counted), as ``apply_precision`` would convert them (the
    configured or default scope; under the default, widths not multiples of 16 left out).
    Reads weight shapes only, so a model built on the meta device will do."""
    targets = select_scope(model, scope_patterns(precision))
    shapes: dict[tuple[int, int], int] = {}
    for local in targets.values():
        mod = model.get_submodule(local)
        if isinstance(mod, GroupedExperts):
            continue  # grouped GEMMs, not (in, out) linears: k3train.quant.fp8_grouped
        out_f, in_f = mod.weight.shape
        if precision.scope is None and (in_f % 16 or out_f % 16):
            continue
        shapes[(in_f, out_f)] = shapes.get((in_f, out_f), 0) + 1
    return shapes


def apply_precision(model: nn.Module, precision: PrecisionConfig, device: str | torch.device = "cpu", *,
                    layer_offset: int = 0, require_match: bool = True) -> list[str]:
    """Configure ``model``'s in-scope layers for ``precision.recipe``; returns their global names.

    Idempotent (applying twice changes nothing). ``layer_offset``: global index of the chunk's
    first layer. ``require_match=False`` lets a pipeline chunk hold none of a pattern's modules.
    """
    validate_precision(precision, device)
    if precision.recipe in ("bf16", "fp32"):   # plain layers; fp32 differs only in the trainer's autocast
        return []
    targets = select_scope(model, scope_patterns(precision), layer_offset, require_match)
    if precision.recipe == "fp8" and precision.fp8_backend == "te":
        return _apply_te(model, targets, precision.fp8_recipe, skip_unfit=precision.scope is None)
    if precision.recipe == "fp8":
        return _apply_fp8(model, targets, skip_unfit=precision.scope is None)
    else:
        spec = MX_SPECS[precision.recipe]
        for name, local in targets.items():
            _apply_mx(model, name, local, spec)
    return list(targets)
