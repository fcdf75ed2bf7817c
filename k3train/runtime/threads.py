"""CPU threads for torch, one rule for every command (``train.threads``).

0 (the default) gives each process the cores available to it (``os.sched_getaffinity``) divided
by the processes torchrun starts on this host (``LOCAL_WORLD_SIZE``), so several ranks on one
machine do not oversubscribe it; a user's ``OMP_NUM_THREADS`` is kept, as torch itself keeps it.
N > 0 is exactly N."""
from __future__ import annotations

import os

import torch


def cores_available() -> int:
    """Cores this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_for(setting: int, local_processes: int, cores: int) -> int:
    """The thread count ``train.threads=setting`` gives one of ``local_processes`` processes."""
    if setting > 0:
        return setting
    return max(1, cores // max(1, local_processes))


def apply_threads(setting: int) -> int:
    """Set torch's intra-op threads by the rule above; returns the count in force."""
    if setting == 0 and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    n = threads_for(setting, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), cores_available())
    torch.set_num_threads(n)
    return n


def thread_lines() -> list[str]:
    """``k3train env``'s lines: threads in force, cores, load, and a warning when oversubscribed."""
    cores = cores_available()
    lines = [f"threads: torch {torch.get_num_threads()} of {cores} cores available"
             f"{' (OMP_NUM_THREADS=' + os.environ['OMP_NUM_THREADS'] + ')' if os.environ.get('OMP_NUM_THREADS') else ''}"
             f"; train.threads=0 gives each process cores / local processes"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > cores:
        lines.append(f"warning: load average {load:.1f} exceeds the {cores} cores: other work shares them, "
                     f"so runs here will be slower than their figures")
    return lines
