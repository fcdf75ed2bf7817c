"""The host-read counter the dispatch tests and the CUDA-graph check rely on."""
from __future__ import annotations

import torch

from benchmarks.host_reads import count_host_reads


def _read_twice(t: torch.Tensor) -> None:
    t.sum().item()
    t.tolist()


def test_counts_item_and_tolist_and_names_the_caller():
    with count_host_reads() as reads:
        _read_twice(torch.ones(3))
    assert reads[0] == 2
    assert all(site.endswith("in _read_twice") and "test_host_reads.py" in site for site in reads[1:])
    assert len(reads) == 3
    torch.ones(1).item()  # restored on exit: not counted
    assert reads[0] == 2


def test_device_only_skips_cpu_tensors():
    # the reads torch.compile's generated code makes of CPU scalar arguments are no device sync
    with count_host_reads(device_only=True) as reads:
        _read_twice(torch.ones(3))
    assert reads == [0]
