"""Pad expert groups of sorted rows to a multiple of ``align`` rows, without a host sync.

FP8 grouped GEMMs (torchao's rowwise-scaled ``_scaled_grouped_mm``) need every group's row
count to be a multiple of 16: the weight-gradient GEMM reduces over a group's rows, and float8
operands must start on 16-byte (16-element) boundaries. The rows are scattered into a buffer
whose size is a bound known without reading the counts (``M + G * (align - 1)``), so the GPU
never waits for the host. Padding rows are zeros and stay zeros through the experts
(SiTU-GLU(0, 0) = 0), so they change no amax, hence no scale, and no result.
"""
from __future__ import annotations

import torch


def pad_groups(x: torch.Tensor, counts: torch.Tensor, align: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: ``[M, K]`` rows grouped by expert with ``counts [G]`` -> (x_pad ``[M + G*(align-1), K]``
    with zero padding rows, offs ``[G]`` int32 padded cumulative ends, rows ``[M]`` int64 where
    each row of x went; ``y_pad.index_select(0, rows)`` undoes the padding). Differentiable
    in x (the padding rows get no gradient)."""
    m, g = x.shape[0], counts.numel()
    counts = counts.to(device=x.device, dtype=torch.int64)
    padded = (counts + (align - 1)) // align * align
    pad_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    # output_size: repeat_interleave would otherwise read the counts' sum on the host.
    group = torch.repeat_interleave(torch.arange(g, device=x.device), counts, output_size=m)
    rows = torch.arange(m, device=x.device) - start[group] + pad_start[group]
    x_pad = x.new_zeros(m + g * (align - 1), x.shape[1]).index_copy(0, rows, x)
    return x_pad, torch.cumsum(padded, 0).to(torch.int32), rows
