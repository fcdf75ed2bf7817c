"""The kernel backend registry: which implementation each op family runs in this process.

One place decides, from the run's ``kernels:`` config section (``KernelsConfig``): ``resolve``
turns it (with the environment overrides, read once) into a frozen ``KernelChoices``, and
``apply`` resolves and delivers it. ``train()`` calls ``apply(cfg)`` before it builds anything
and writes ``resolved(device)`` to ``RUN_DIR/kernels.json``, so two runs of one config run the
same kernels and the run directory says which. Until ``apply`` is called the defaults hold
(``KernelsConfig()``: the fastest installed kernel on CUDA, torch elsewhere).

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

Off CUDA every family is ``torch`` (the CPU path is the reference). Delivery is one mechanism
for all three packages: ``k3train.ops.backends``, ``moe.backends`` and ``optim.backends`` each
define a frozen ``Backends`` dataclass and ``set_backends``; ``deliver`` fills all three (``moe``
and ``optim`` never import ``k3train``), and the ops read their package's ``current()``. Beside
each Triton backend sits its verifier of shapes and dtypes (``moe.topk.TritonTopk``,
``moe.permute_fused.TritonRows``, ``k3train.ops.short_conv.TritonShortConv``).

Environment overrides, each of one field and read only here (documented in the README):
``K3TRAIN_KERNELS`` (``kernels.backend``), ``K3TRAIN_COMPILE=0|1`` (``kernels.compile``),
``K3TRAIN_AUTOTUNE`` (``kernels.autotune``), read once when the choices are resolved (never
per call). The resolved file records the values in force.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import types
from pathlib import Path
from typing import Iterator, Mapping

import torch

from k3train.config.schema import KernelsConfig
from k3train.errors import K3TrainError
from k3train.ops import autotune_picks
from k3train.ops import backends as ops_backends
from k3train.ops.backends import Backends as OpsBackends
from k3train.ops.triton_compile import configure_autotune
from moe import backends as moe_backends
from moe.backends import Backends as MoeBackends
from optim import backends as optim_backends
from optim.backends import Backends as OptimBackends

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


def _env_overrides(cfg: KernelsConfig, env: Mapping[str, str]) -> KernelsConfig:
    """``cfg`` with the documented environment overrides ``env`` (variable -> value, read once
    by ``resolve``) applied, validated like the fields."""
    updates = {}
    for var, field in ENV_OVERRIDES.items():
        raw = env.get(var)
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


@dataclasses.dataclass(frozen=True)
class KernelChoices:
    """The kernel choices of one process, resolved once (``resolve``) and then read-only.

    ``families``: each family's backend on CUDA (off CUDA every family is torch);
    ``compile_cuda``: whether CUDA calls of the small fused pieces go through ``torch.compile``;
    ``autotune``, ``autotune_bench_ms``, ``autotune_picks``: the Triton autotuning settings;
    ``requested``: the config section with the environment overrides applied;
    ``env_overrides``: the override variables that were set when it was resolved."""

    families: Mapping[str, str]
    compile_cuda: bool
    autotune: str
    autotune_bench_ms: float
    autotune_picks: str
    requested: KernelsConfig
    env_overrides: Mapping[str, str]
    pipeline_gpu: bool = False

    def backend(self, family: str, device: torch.device | str) -> str:
        """The backend ``family`` runs for tensors on ``device``: one of ``FAMILIES[family]``."""
        if family not in FAMILIES:
            raise KeyError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
        return self.families[family] if torch.device(device).type == "cuda" else "torch"

    def compile_enabled(self, device: torch.device | str) -> bool:
        """Whether the small fused pieces go through ``torch.compile`` for tensors on ``device``."""
        return torch.device(device).type == "cuda" and self.compile_cuda

    def uses_triton(self, device: torch.device | str) -> bool:
        """Whether any family runs a Triton kernel (fla's or ours) on ``device``."""
        return any(self.backend(f, device) != "torch" for f in FAMILIES)

    def record(self, device: torch.device | str) -> dict:
        """Every family's backend on ``device``, the compile switch and the autotune settings,
        plus the config values and overrides they came from: what ``RUN_DIR/kernels.json`` holds."""
        return {"device": torch.device(device).type,
                "families": {f: self.backend(f, device) for f in FAMILIES},
                "compile": self.compile_enabled(device), "autotune": self.autotune,
                "autotune_bench_ms": self.autotune_bench_ms,
                "autotune_picks": self._picks_in_force(device),
                "requested": self.requested.model_dump(), "env_overrides": dict(self.env_overrides)}

    def _picks_in_force(self, device) -> str | None:
        """The picks file a full-autotune CUDA run reads (None: every kernel is tuned)."""
        if torch.device(device).type != "cuda" or self.autotune != "full":
            return None
        return autotune_picks.source(self.autotune_picks)

    def ops_backends(self) -> OpsBackends:
        return OpsBackends(kda=self.families["kda"], attnres=self.families["attnres"],
                           short_conv=self.families["short_conv"], compile=self.compile_cuda,
                           autotune=self.autotune, autotune_bench_ms=self.autotune_bench_ms,
                           autotune_picks=self.autotune_picks)

    def moe_backends(self) -> MoeBackends:
        return MoeBackends(router_topk=self.families["router_topk"],
                           moe_permute=self.families["moe_permute"], compile=self.compile_cuda)

    def optim_backends(self) -> OptimBackends:
        return OptimBackends(momentum=self.families["muon_momentum"], ns_gemm=self.families["ns_gemm"])


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


def resolve(cfg, *, pipeline_gpu: bool | None = None) -> KernelChoices:
    """``cfg`` (a ``RunConfig`` or its ``KernelsConfig``) resolved into the frozen choices.

    The environment overrides are read here, once, and recorded. ``pipeline_gpu``: whether this
    is a pipeline-parallel GPU run (recorded; default: read from a ``RunConfig``'s
    ``parallel.pp`` and ``train.device``). Every choice is validated as CUDA
    would see it, now, rather than at a kernel's first call: raises ``KernelChoiceError`` when a
    requested backend is not installed or an override is malformed."""
    kernels = getattr(cfg, "kernels", cfg)
    if pipeline_gpu is None:
        pipeline_gpu = hasattr(cfg, "parallel") and cfg.parallel.pp > 1 and cfg.train.device != "cpu"
    env = {var: os.environ[var] for var in ENV_OVERRIDES if os.environ.get(var)}
    s = _env_overrides(kernels, env)
    families = {f: _resolve(f, s, "cuda") for f in FAMILIES}
    check_autotune_picks(s.autotune_picks)
    if s.backend == "torch" and s.compile == "auto":
        compile_cuda = False
    elif s.compile == "auto":
        # On under pipeline parallelism too: compile-ahead (``TrainState.compile_kernels``) runs
        # a throwaway step through the engine on every rank before step 1, so no rank loads
        # Inductor kernels inside step 1 while its peers wait.
        compile_cuda = True
    else:
        compile_cuda = bool(s.compile)
    return KernelChoices(families=types.MappingProxyType(families), compile_cuda=compile_cuda,
                         autotune=s.autotune, autotune_bench_ms=s.autotune_bench_ms,
                         autotune_picks=s.autotune_picks, requested=s,
                         env_overrides=types.MappingProxyType(env), pipeline_gpu=bool(pipeline_gpu))


def deliver(choices: KernelChoices) -> None:
    """Hand every package its part of ``choices``, the one way: ``k3train.ops``, ``moe`` and
    ``optim`` each take a frozen ``Backends`` through their ``set_backends``."""
    _CURRENT[0] = choices
    ops_backends.set_backends(choices.ops_backends())
    moe_backends.set_backends(choices.moe_backends())
    optim_backends.set_backends(choices.optim_backends())
    configure_autotune()


def apply(cfg, *, pipeline_gpu: bool | None = None) -> KernelChoices:
    """Resolve ``cfg`` (``resolve``) and make it the process's kernel choices (``deliver``);
    returns the frozen choices. On a refused config the choices in force stay."""
    choices = resolve(cfg, pipeline_gpu=pipeline_gpu)
    deliver(choices)
    return choices


def current() -> KernelChoices:
    """The choices in force (the defaults with the environment's overrides until a run applies
    its config)."""
    return _CURRENT[0]


def backend(family: str, device: torch.device | str) -> str:
    """The backend ``family`` runs for tensors on ``device`` under the choices in force."""
    return current().backend(family, device)


def uses_triton(device: torch.device | str) -> bool:
    """Whether any family runs a Triton kernel (fla's or ours) on ``device``: what makes a
    compile-ahead pass worth running."""
    return current().uses_triton(device)


def compile_enabled(device: torch.device | str) -> bool:
    """Whether the small fused pieces go through ``torch.compile`` for tensors on ``device``."""
    return current().compile_enabled(device)


def autotune_mode() -> str:
    """``full`` or ``fixed``: how Triton's autotuners pick a candidate (``kernels.autotune``)."""
    return current().autotune


def resolved(device: torch.device | str) -> dict:
    """``current().record(device)``: what ``RUN_DIR/kernels.json`` records."""
    return current().record(device)


@contextlib.contextmanager
def using(**fields) -> Iterator[KernelChoices]:
    """Run a block with some ``kernels`` fields changed (benchmarks comparing backends side by
    side; tests), restoring the choices after. ``with kernels.using(short_conv="fla"): ...``"""
    previous = current()
    choices = apply(previous.requested.model_copy(update=fields), pipeline_gpu=previous.pipeline_gpu)
    try:
        yield choices
    finally:
        deliver(previous)


def write_resolved(run_dir: str | Path, device: torch.device | str) -> dict:
    """Write ``resolved(device)`` to ``run_dir/kernels.json``; returns it."""
    out = resolved(device)
    Path(run_dir, "kernels.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


# Until a run applies its config, the defaults (with the environment's overrides, read once
# here) hold, so scripts and tests that build modules directly get the same choices.
_CURRENT: list[KernelChoices] = [resolve(KernelsConfig(), pipeline_gpu=False)]
deliver(_CURRENT[0])


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
