"""The kernel backend registry: which implementation each op family runs in this process.

One place decides, from the run's ``kernels:`` config section (``KernelsConfig``), and every op
family asks it (``backend(family, device)``). ``train()`` calls ``apply(cfg)`` before it builds
anything and writes ``resolved(device)`` to ``RUN_DIR/kernels.json``, so two runs of one config
run the same kernels and the run directory says which. Until ``apply`` is called the defaults
hold (``KernelsConfig()``: the fastest installed kernel on CUDA, torch elsewhere).

Families and their backends (``auto`` is the first one listed that is installed):

============== ========================= ==================================================
family         backends on CUDA          what
============== ========================= ==================================================
kda            fla, torch                chunked KDA recurrence (fla's ``chunk_kda``)
attnres        fla, torch                AttnRes depth mix (fla's ``fused_attnres``)
short_conv     k3train, fla, torch       KDA short conv + SiLU (ours; fla's causal_conv1d)
router_topk    k3train, torch            router / Quantile Balancing top-k (ours; torch.topk)
moe_permute    k3train, torch            MoE dispatch/combine row passes (ours; gathers)
muon_momentum  k3train, torch            Muon momentum + Nesterov input in one pass (ours)
ns_gemm        k3train, torch            Newton-Schulz ``beta C + alpha A B`` (ours; baddbmm)
============== ========================= ==================================================

Off CUDA every family is ``torch`` (the CPU path is the reference). ``moe`` and ``optim`` do
not import ``k3train``: ``apply`` hands them their resolved choices (``moe.topk.set_kernel``,
``moe.compile.set_compile``, ``optim.muon.set_kernels``), and they read nothing else.

Environment overrides, each of one field and read only here (documented in the README):
``K3TRAIN_KERNELS`` (``kernels.backend``), ``K3TRAIN_COMPILE=0|1`` (``kernels.compile``),
``K3TRAIN_AUTOTUNE`` (``kernels.autotune``). The resolved file records the values in force.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Iterator

import torch

from k3train.config.schema import KernelsConfig
from k3train.errors import K3TrainError
from k3train.ops import autotune_picks
from k3train.ops.triton_compile import AutotuneSettings, configure_autotune
from moe import compile as moe_compile
from moe import permute_fused, topk
from optim import muon

FAMILIES: dict[str, tuple[str, ...]] = {
    "kda": ("fla", "torch"),
    "attnres": ("fla", "torch"),
    "short_conv": ("k3train", "fla", "torch"),
    "router_topk": ("k3train", "torch"),
    "moe_permute": ("k3train", "torch"),
    "muon_momentum": ("k3train", "torch"),
    "ns_gemm": ("k3train", "torch"),
}

# The environment variables that may override a field, and which field.
ENV_OVERRIDES = {"K3TRAIN_KERNELS": "backend", "K3TRAIN_COMPILE": "compile", "K3TRAIN_AUTOTUNE": "autotune"}


class KernelChoiceError(K3TrainError, ValueError):
    """A requested backend cannot run here (not installed), or an override has a bad value."""


def _env_overrides(cfg: KernelsConfig) -> KernelsConfig:
    """``cfg`` with the documented environment overrides applied (validated like the fields)."""
    updates = {}
    for var, field in ENV_OVERRIDES.items():
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        if field == "compile":
            value, allowed = {"0": False, "1": True, "auto": "auto"}.get(raw), ("0", "1", "auto")
        else:
            value, allowed = raw, KernelsConfig.model_fields[field].annotation.__args__
        if value is None or value not in allowed and field != "compile":
            raise KernelChoiceError(f"{var}={raw!r} (overrides kernels.{field}): allowed values are "
                                    f"{', '.join(map(repr, allowed))}")
        updates[field] = value
    return cfg.model_copy(update=updates) if updates else cfg


class _Registry:
    """The process's kernel settings: the config section in force and the pipeline depth."""

    def __init__(self):
        self.cfg = KernelsConfig()
        self.pipeline_gpu = False  # a PP > 1 run on GPUs: compile=auto resolves to off
        self._cached: tuple | None = None  # (cfg, override values, settings)

    def settings(self) -> KernelsConfig:
        # Asked on every op call: recompute (a pydantic copy) only when the config or an
        # override changed, not per call.
        env = tuple(os.environ.get(var) for var in ENV_OVERRIDES)
        if self._cached is None or self._cached[0] is not self.cfg or self._cached[1] != env:
            self._cached = (self.cfg, env, _env_overrides(self.cfg))
        return self._cached[2]


_REGISTRY = _Registry()


@functools.cache
def installed(backend: str) -> bool:
    """Whether a backend's package imports here: ``fla`` (flash-linear-attention) or
    ``k3train`` (our kernels, which need Triton); ``torch`` always."""
    if backend == "torch":
        return True
    module = {"fla": "fla", "k3train": "triton"}[backend]
    return importlib.util.find_spec(module) is not None


def _resolve(family: str, settings: KernelsConfig, device_type: str) -> str:
    if family not in FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    if device_type != "cuda" or settings.backend == "torch":
        return "torch"
    want = getattr(settings, family)
    if want == "auto":
        return next(b for b in FAMILIES[family] if installed(b))
    if not installed(want):
        extra = "the gpu extra (flash-linear-attention)" if want == "fla" else "Triton"
        raise KernelChoiceError(f"kernels.{family}={want} but {extra} is not installed here; "
                                f"install it or use kernels.{family}=auto (allowed: auto, "
                                f"{', '.join(FAMILIES[family])})")
    return want


def backend(family: str, device: torch.device | str) -> str:
    """The backend ``family`` runs for tensors on ``device``: one of ``FAMILIES[family]``."""
    return _resolve(family, _REGISTRY.settings(), torch.device(device).type)


def uses_triton(device: torch.device | str) -> bool:
    """Whether any family runs a Triton kernel (fla's or ours) on ``device``: what makes a
    compile-ahead pass worth running."""
    return any(backend(f, device) != "torch" for f in FAMILIES)


def compile_enabled(device: torch.device | str) -> bool:
    """Whether the small fused pieces go through ``torch.compile`` for tensors on ``device``."""
    s = _REGISTRY.settings()
    if torch.device(device).type != "cuda" or s.backend == "torch" and s.compile == "auto":
        return False
    if s.compile == "auto":
        return not _REGISTRY.pipeline_gpu
    return bool(s.compile)


def autotune_mode() -> str:
    """``full`` or ``fixed``: how Triton's autotuners pick a candidate (``kernels.autotune``)."""
    return _REGISTRY.settings().autotune


def autotune_bench_ms() -> float:
    """Timed window per candidate under ``full`` autotuning, ms (``kernels.autotune_bench_ms``;
    0: Triton's default)."""
    return _REGISTRY.settings().autotune_bench_ms


def autotune_picks_spec() -> str:
    """``kernels.autotune_picks``: ``auto``, ``none`` or the path of a picks file."""
    return _REGISTRY.settings().autotune_picks


def check_autotune_picks(spec: str) -> None:
    """Refuse a ``kernels.autotune_picks`` path that is no picks file, in one line."""
    if spec in ("auto", "none"):
        return
    if not Path(spec).is_file():
        raise KernelChoiceError(f"kernels.autotune_picks={spec!r}: no such file; allowed: auto, none, or the "
                                "path of a picks file (a full-autotune run writes RUN_DIR/autotune_picks.json)")
    try:
        autotune_picks.read_picks(spec)
    except ValueError as exc:
        raise KernelChoiceError(str(exc)) from None


def resolved(device: torch.device | str) -> dict:
    """Every family's backend on ``device``, the compile switch and the autotune mode, plus the
    config values and overrides they came from: what ``RUN_DIR/kernels.json`` records."""
    s = _REGISTRY.settings()
    overrides = {var: os.environ[var] for var in ENV_OVERRIDES if os.environ.get(var)}
    return {"device": torch.device(device).type,
            "families": {f: backend(f, device) for f in FAMILIES},
            "compile": compile_enabled(device), "autotune": s.autotune,
            "autotune_bench_ms": s.autotune_bench_ms, "autotune_picks": _picks_in_force(s, device),
            "requested": s.model_dump(), "env_overrides": overrides}


def _picks_in_force(s: KernelsConfig, device) -> str | None:
    """The picks file a full-autotune CUDA run reads (None: every kernel is tuned)."""
    if torch.device(device).type != "cuda" or s.autotune != "full":
        return None
    return autotune_picks.source(s.autotune_picks)


def _push_to_packages(device_type: str = "cuda") -> None:
    """Hand ``moe`` and ``optim`` (which never import k3train) their CUDA choices."""
    moe_compile.set_compile(compile_enabled(device_type))
    topk.set_kernel(backend("router_topk", device_type))
    permute_fused.set_kernel(backend("moe_permute", device_type))
    muon.set_kernels(momentum=backend("muon_momentum", device_type), ns_gemm=backend("ns_gemm", device_type))


def apply(cfg, *, pipeline_gpu: bool | None = None) -> None:
    """Make ``cfg`` (a ``RunConfig`` or its ``KernelsConfig``) the process's kernel settings.

    ``pipeline_gpu``: whether this is a pipeline-parallel GPU run (default: read from a
    ``RunConfig``'s ``parallel.pp`` and ``train.device``). Raises ``KernelChoiceError`` when a
    requested backend is not installed or an override is malformed."""
    kernels = getattr(cfg, "kernels", cfg)
    if pipeline_gpu is None:
        pipeline_gpu = hasattr(cfg, "parallel") and cfg.parallel.pp > 1 and cfg.train.device != "cpu"
    previous = (_REGISTRY.cfg, _REGISTRY.pipeline_gpu)
    _REGISTRY.cfg, _REGISTRY.pipeline_gpu = kernels, bool(pipeline_gpu)
    try:
        # Validate every choice as CUDA would see it, now, rather than at a kernel's first call.
        for family in FAMILIES:
            _resolve(family, _REGISTRY.settings(), "cuda")
        check_autotune_picks(_REGISTRY.settings().autotune_picks)
        _push_to_packages()
    except Exception:
        _REGISTRY.cfg, _REGISTRY.pipeline_gpu = previous
        _push_to_packages()
        raise
    configure_triton()


def autotune_settings() -> AutotuneSettings:
    """The autotune fields in force, as the patched Triton autotuner reads them."""
    s = _REGISTRY.settings()
    return AutotuneSettings(mode=s.autotune, picks_spec=s.autotune_picks, bench_ms=s.autotune_bench_ms)


def configure_triton() -> str:
    """Point Triton's autotuners (fla's included) at this registry's autotune fields."""
    return configure_autotune(autotune_settings)


@contextlib.contextmanager
def using(**fields) -> Iterator[None]:
    """Run a block with some ``kernels`` fields changed (benchmarks comparing backends side by
    side; tests), restoring the settings after. ``with kernels.using(short_conv="fla"): ...``"""
    previous = (_REGISTRY.cfg, _REGISTRY.pipeline_gpu)
    apply(_REGISTRY.cfg.model_copy(update=fields), pipeline_gpu=_REGISTRY.pipeline_gpu)
    try:
        yield
    finally:
        apply(previous[0], pipeline_gpu=previous[1])


def write_resolved(run_dir: str | Path, device: torch.device | str) -> dict:
    """Write ``resolved(device)`` to ``run_dir/kernels.json``; returns it."""
    out = resolved(device)
    Path(run_dir, "kernels.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


# The packages start from the defaults (and the environment's overrides) even before a run
# applies its config: scripts and tests that build modules directly get the same choices.
_push_to_packages()


def report_lines() -> list[str]:
    """``k3train env``'s kernel table: the backend of each op family on each visible device (and
    what CUDA would pick where no GPU is visible), compile and autotune, environment overrides."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    resolved_by = {d: resolved(d) for d in devices}
    head = "".join(f"{d:<10}" for d in devices)
    out = ["kernel backends (k3train/ops/kernels.py; config section kernels:):",
           f"  {'family':<16}{head}" + ("" if torch.cuda.is_available() else "cuda (if a GPU were visible)")]
    for family in FAMILIES:
        cells = "".join(f"{resolved_by[d]['families'][family]:<10}" for d in devices)
        cuda_guess = "" if torch.cuda.is_available() else backend(family, "cuda")
        out.append(f"  {family:<16}{cells}{cuda_guess}")
    out.append(f"  torch.compile of fused pieces on CUDA: {'on' if compile_enabled('cuda') else 'off'}; "
               f"autotune: {autotune_mode()}")
    overrides = resolved_by["cpu"]["env_overrides"]
    if overrides:
        out.append(f"  environment overrides in force: {overrides}")
    return out
