"""The one device resolver: ``train.device`` (or ``--device``) -> the torch device a run uses."""
from __future__ import annotations

import torch

from k3train.errors import UsageError


def resolve_device(choice: str | torch.device, *, setting: str = "train.device",
                   check_available: bool = True) -> torch.device:
    """"auto" -> cuda when a CUDA device is visible, else cpu; "cpu"/"cuda" as given; a
    ``torch.device`` unchanged. With ``check_available``, "cuda" on a machine without one raises
    naming ``setting`` (the key or flag the user set). Building on the meta device for a CUDA
    config on a CPU machine (model-info) passes ``check_available=False``."""
    if isinstance(choice, torch.device):
        return choice
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and check_available and not torch.cuda.is_available():
        raise UsageError(f"{setting}=cuda but no CUDA device is visible; use {setting}=cpu or auto")
    return torch.device(choice)
