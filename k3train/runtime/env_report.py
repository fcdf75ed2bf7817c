"""``k3train env``: what this installation is and what it will run.

k3train's version and commit, Python and platform, every dependency's installed version
against the range k3train declares (the ranges are the versions this project has run, see
docs/dependencies.md), CUDA and Triton availability, and the backend each op family's kernel
registry picks on this machine's devices (``k3train/ops/kernels.py``).
"""
from __future__ import annotations

import importlib.metadata as metadata
import platform
import subprocess
import sys
from pathlib import Path

import k3train
from k3train.runtime.threads import thread_lines

# Distribution names in the order a reader wants them; the extra each belongs to (None: core).
PACKAGES = [("torch", None), ("megatron-core", None), ("numpy", None), ("pydantic", None),
            ("pyyaml", None), ("tqdm", None), ("matplotlib", None), ("wandb", None),
            ("safetensors", None), ("triton", "dev"), ("pytest", "dev"), ("pytest-timeout", "dev"),
            ("tokenizers", "tokenizers"), ("tiktoken", "tiktoken"), ("sentencepiece", "sentencepiece"),
            ("pyarrow", "parquet"), ("transformers", "hf"), ("tensorboard", "tensorboard"),
            ("flash-linear-attention", "gpu"), ("torchao", "gpu"), ("transformer-engine", "te")]


def version() -> str:
    """k3train's installed version (the package metadata), else the source's ``__version__``."""
    try:
        return metadata.version("k3train")
    except metadata.PackageNotFoundError:
        return k3train.__version__


def commit() -> str:
    """The git commit of the source tree k3train runs from (``+dirty`` with local changes), or
    ``unknown`` outside a git checkout."""
    here = Path(k3train.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here, timeout=5)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here, timeout=5).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _requirements() -> list[str]:
    """k3train's requirement strings: from the installed metadata, else (a source tree put on
    ``PYTHONPATH`` without installing, as on a borrowed GPU machine) from its pyproject.toml."""
    try:
        return metadata.requires("k3train") or []
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(k3train.__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.is_file():
        return []
    import tomllib

    project = tomllib.loads(pyproject.read_text()).get("project", {})
    return [*project.get("dependencies", []),
            *(r for extra in project.get("optional-dependencies", {}).values() for r in extra)]


def declared_ranges() -> dict[str, str]:
    """Distribution name (lower case) -> the version range k3train declares."""
    reqs = _requirements()
    out = {}
    for req in reqs:
        spec = req.split(";")[0].strip()
        name = spec
        for i, ch in enumerate(spec):
            if ch in "<>=!~[ ":
                name, rest = spec[:i], spec[i:]
                break
        else:
            rest = ""
        out[name.lower()] = rest.split("]")[-1].strip() if "[" in rest else rest.strip()
    return out


def in_range(installed: str, spec: str) -> bool | None:
    """Whether ``installed`` satisfies ``spec`` (local labels such as ``+cpu`` ignored); None
    where ``packaging`` (a matplotlib dependency) cannot be imported."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        return None
    return Version(installed).public in SpecifierSet(spec) if spec else True


def dependency_rows() -> list[dict]:
    """One dict per package: name, extra, installed version (None: absent), range, status."""
    ranges = declared_ranges()
    rows = []
    for name, extra in PACKAGES:
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        spec = ranges.get(name, "")
        ok = in_range(have, spec) if have else None
        status = ("not installed" + (f" (extra '{extra}')" if extra else " (required)") if have is None
                  else "ok" if ok else "unchecked" if ok is None else "OUTSIDE the tested range")
        rows.append({"name": name, "extra": extra, "installed": have, "range": spec, "status": status})
    return rows


def device_lines() -> list[str]:
    import torch

    lines = [f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"CUDA: {len(names)} device(s): {', '.join(names)}")
    else:
        lines.append("CUDA: not available (runs use the CPU)")
    try:
        import triton

        lines.append(f"Triton: {triton.__version__} (kernels on CUDA; CPU tests use its interpreter)")
    except ImportError:
        lines.append("Triton: not installed (CUDA runs fall back to torch kernels)")
    return lines


def report(kernel_lines: list[str] = ()) -> str:
    """The whole ``k3train env`` text; ``kernel_lines`` (from ``k3train.ops.kernels.report_lines``,
    passed in by the command: the kernel registry sits above this room) close it."""
    out = [f"k3train {version()} (commit {commit()})",
           f"python {platform.python_version()} on {platform.platform()} ({sys.executable})", "",
           "dependencies (range = versions this project has run):"]
    for r in dependency_rows():
        out.append(f"  {r['name']:<24}{r['installed'] or '-':<18}{r['range'] or '-':<18}{r['status']}")
    out += ["", *device_lines(), *thread_lines()]
    if kernel_lines:
        out += ["", *kernel_lines]
    return "\n".join(out)
