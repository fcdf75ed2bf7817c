"""Autotune picks: the candidate each Triton autotuner chose, recorded by one run and reused by
the next, on any machine with the same GPU model.

Why: under ``kernels.autotune=full`` a fresh machine compiles every candidate of every
autotuned kernel (most of the time to step 1 of k3_mini on a fresh GPU: benchmarks/README.md,
"First step on a fresh machine") and then times them, although a run on the same GPU model has already found the winner. Triton's
own on-disk cache (``cache_results``) helps only on the machine that wrote it: its key hashes
the Triton build, the backend and the kernel's source. The picks here are keyed by what decides
the choice, so they travel:

* ``kernel``: the autotuned function's module and name (``fla.ops.kda.chunk_intra.chunk_kda_fwd_kernel_intra_sub_chunk``);
* ``key``: the tuning key as Triton forms it (the values of the kernel's ``key`` arguments, then
  every tensor argument's dtype), written as its ``repr``;
* the chosen config: its ``kwargs``, ``num_warps``, ``num_stages``, ``num_ctas``, ``maxnreg``.

A pick is used only when the running kernel still has a candidate equal to it, so a changed
kernel (another fla release) falls back to tuning, never to a config its authors dropped. A
file also names the GPU it was tuned on (``torch.cuda.get_device_name``), and is used only on
that model: the fastest tile differs between GPUs.

Every run under ``full`` writes ``RUN_DIR/autotune_picks.json`` (after step 1 and at the end).
``kernels.autotune_picks`` chooses what a run reads: ``auto`` (default) the project's file for
this GPU, ``k3train/ops/autotune_data/<gpu>.json``, where one ships; ``none``; or a path (an
earlier run's file). To ship picks for a GPU, copy a full-autotune run's file there.
"""
from __future__ import annotations

import json
import re
import weakref
from pathlib import Path

SHIPPED_DIR = Path(__file__).with_name("autotune_data")
FORMAT = 1

# Autotuners that chose a config in this process (the pruning hook adds them): what a run records.
_seen: "weakref.WeakSet" = weakref.WeakSet()
# The table in force for one kernels.autotune_picks value: {kernel: {key repr: config fields}} and
# the file it came from (None until loaded, and where no file applies).
_loaded: dict = {"spec": None, "table": None, "source": None}


def python_function(kernel):
    """The Python function under a Triton kernel object: Autotuner -> Heuristics -> JITFunction -> fn."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def kernel_id(tuner) -> str:
    """``module.function`` of the Python function under an autotuner (through heuristics)."""
    fn = python_function(tuner)
    return f"{getattr(fn, '__module__', '') or ''}.{getattr(fn, '__qualname__', None) or getattr(fn, '__name__', '?')}"


def tuning_key(tuner, kwargs: dict) -> tuple:
    """The key Triton's ``Autotuner.run`` caches a choice under, for a launch with ``tuner.nargs``
    (set by ``run`` before it prunes) and ``kwargs``: the ``key`` arguments' values, then the
    dtype of every tensor argument."""
    args = {k: v for k, v in {**(tuner.nargs or {}), **kwargs}.items() if k in tuner.arg_names}
    key = [args[k] for k in tuner.keys if k in args]
    key += [str(v.dtype) for v in args.values() if hasattr(v, "dtype")]
    return tuple(key)


def config_fields(cfg) -> dict:
    """What identifies a Triton ``Config``: its meta-parameters and launch settings."""
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)}


def gpu_slug(name: str) -> str:
    """File name stem for a GPU model: ``NVIDIA H200`` -> ``nvidia_h200``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _device_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no usable GPU: nothing to pick for
        return None


def read_picks(path: str | Path) -> dict:
    """A picks file as ``{"device": str, "kernels": {kernel: {key repr: config fields}}}``;
    raises ValueError naming the file when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"kernels.autotune_picks: cannot read {path} as a picks file ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("kernels"), dict):
        raise ValueError(f"kernels.autotune_picks: {path} is not an autotune picks file (format {FORMAT}, "
                         "as a run writes to RUN_DIR/autotune_picks.json)")
    return data


def resolve_source(spec: str, device_name: str | None) -> Path | None:
    """The file ``kernels.autotune_picks`` = ``spec`` names on a GPU called ``device_name``."""
    if spec == "none" or device_name is None:
        return None
    if spec == "auto":
        path = SHIPPED_DIR / f"{gpu_slug(device_name)}.json"
        return path if path.is_file() else None
    return Path(spec)


def table(spec: str) -> dict:
    """``{kernel: {key repr: config fields}}`` in force for ``kernels.autotune_picks`` = ``spec``
    on this process's GPU (empty where none applies); loaded once per spec."""
    if _loaded["spec"] != spec:
        device = _device_name()
        source = resolve_source(spec, device)
        kernels = {}
        if source is not None:
            data = read_picks(source)
            if data.get("device") == device:
                kernels = data["kernels"]
        _loaded.update(spec=spec, table=kernels, source=str(source) if kernels else None)
    return _loaded["table"]


def source(spec: str) -> str | None:
    """The picks file in force for ``spec`` (None: every kernel is tuned)."""
    table(spec)
    return _loaded["source"]


def pick(tuner, kwargs: dict, configs: list, picks: dict):
    """The candidate of ``configs`` recorded in ``picks`` for this kernel and launch, else None."""
    by_key = picks.get(kernel_id(tuner))
    if not by_key:
        return None
    want = by_key.get(repr(tuning_key(tuner, kwargs)))
    if want is None:
        return None
    return next((c for c in configs if config_fields(c) == want), None)


def note_tuner(tuner) -> None:
    """Remember an autotuner that chose a config in this process (for ``write_picks``)."""
    _seen.add(tuner)


def collected(tuners=None) -> dict:
    """``{kernel: {key repr: config fields}}`` of every choice the autotuners made so far."""
    out: dict = {}
    for tuner in list(_seen if tuners is None else tuners):
        for key, cfg in getattr(tuner, "cache", {}).items():
            out.setdefault(kernel_id(tuner), {})[repr(key)] = config_fields(cfg)
    return out


def write_picks(path: str | Path, device_name: str | None = None, tuners=None) -> Path | None:
    """Write this process's choices to ``path`` (merged over what the file already holds for the
    same GPU); None, and no file, when nothing was tuned."""
    kernels = collected(tuners)
    if not kernels:
        return None
    device_name = device_name or _device_name()
    path = Path(path)
    if path.is_file():
        try:
            old = read_picks(path)
        except ValueError:
            old = None
        if old is not None and old.get("device") == device_name:
            for k, by_key in old["kernels"].items():
                kernels[k] = {**by_key, **kernels.get(k, {})}
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = None
    path.write_text(json.dumps({"format": FORMAT, "device": device_name, "triton": version,
                                "kernels": dict(sorted(kernels.items()))}, indent=1, sort_keys=False) + "\n")
    return path
