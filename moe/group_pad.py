"""Pad expert groups of sorted rows to a positive multiple of ``align`` rows, without a host sync.

FP8 grouped GEMMs (torchao's rowwise-scaled ``torch._scaled_grouped_mm``) need every group's
row count, and the total row count, to be multiples of 16: the weight-gradient GEMM reduces
over a group's rows, and its float8 operands (one byte per element) must start every group and
every row on a 16-byte boundary. An empty group gets ``align`` zero rows too, so the kernel
never sees an empty group (a case grouped GEMM kernels have got wrong: pytorch/pytorch#172439).
The rows are scattered into a buffer whose size is a bound known without reading the counts,
so the GPU never waits for the host and the step stays capturable in a CUDA graph. Padding rows
are zeros and stay zeros through the experts (SiTU-GLU(0, 0) = 0): they change no amax, hence no
scale, and no result; a group of zero rows has a zero weight gradient.
"""
from __future__ import annotations

import torch


def padded_capacity(num_rows: int, num_groups: int, align: int) -> int:
    """Rows of the padded buffer: a multiple of ``align`` that holds every padded group
    (each group grows by at most ``align`` rows)."""
    return -(-num_rows // align) * align + num_groups * align


def pad_groups(x: torch.Tensor, counts: torch.Tensor, align: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: ``[M, K]`` rows grouped by expert, ``counts [G]`` rows per group ->
    (x_pad ``[padded_capacity(M, G, align), K]``, zero outside the rows of x; offs ``[G]`` int32,
    the padded groups' cumulative ends (group g: ``max(counts[g], 1)`` rounded up to a multiple
    of ``align``); rows ``[M]`` int64, where each row of x went: ``y_pad.index_select(0, rows)``
    undoes the padding). Rows past ``offs[-1]`` belong to no group. Differentiable in x."""
    m, g = x.shape[0], counts.numel()
    counts = counts.to(device=x.device, dtype=torch.int64)
    padded = (counts.clamp(min=1) + (align - 1)) // align * align
    pad_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    # output_size: repeat_interleave would otherwise read the counts' sum on the host.
    group = torch.repeat_interleave(torch.arange(g, device=x.device), counts, output_size=m)
    rows = torch.arange(m, device=x.device) - start[group] + pad_start[group]
    x_pad = x.new_zeros(padded_capacity(m, g, align), x.shape[1]).index_copy(0, rows, x)
    return x_pad, torch.cumsum(padded, 0).to(torch.int32), rows
