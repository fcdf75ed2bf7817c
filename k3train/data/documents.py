"""Document boundaries of packed windows, from the token stream's end-of-document tokens.

The stream is ``doc0 EOD doc1 EOD ...`` and windows are cut across documents
(``k3train/data/dataset.py``). Under ``data.document_mask`` the EOD token *opens* the document
after it, as a beginning-of-sequence token would: the input position holding EOD is the first
token of the next document, so

* the target EOD (predicting the end of a document) is predicted from its own document;
* the target after an input EOD (the first token of the next document) is predicted from the
  EOD alone, not from the document before it;
* no target is masked: every token of every document stays a target exactly once per epoch,
  as without masking (the windows and the loss are unchanged; only what each position sees is).

Row starts are document starts too: a window's first token opens a (possibly partial) document.
The boundaries are ``cu_seqlens`` (``k3train/ops/documents.py``): LongTensor ``[N+1]`` over the
``B*T`` input tokens flattened row by row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["WindowDocuments", "document_count", "document_cu_seqlens", "document_cu_seqlens_padded",
           "max_documents", "window_documents"]


def _starts(inputs: torch.Tensor, eod_id: int) -> torch.Tensor:
    """inputs ``[B, T]`` -> bool ``[B, T]``: where a document starts (every EOD, every row start)."""
    starts = inputs == eod_id
    starts[:, 0] = True
    return starts


def document_cu_seqlens(inputs: torch.Tensor, eod_id: int) -> torch.Tensor:
    """inputs ``[B, T]`` -> cu_seqlens ``[N+1]`` (int64, on inputs' device): the flat index of
    every row start and every EOD token, then ``B*T``."""
    B, T = inputs.shape
    idx = _starts(inputs, eod_id).flatten().nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([B * T])])


def window_documents(windows: torch.Tensor, eod_id: int) -> torch.Tensor:
    """windows ``[B, T+1]`` -> the cu_seqlens of their inputs ``windows[:, :-1]``."""
    return document_cu_seqlens(windows[:, :-1], eod_id)


def document_cu_seqlens_padded(inputs: torch.Tensor, eod_id: int, max_docs: int) -> torch.Tensor:
    """``document_cu_seqlens`` in a fixed shape, computed without a host read (a CUDA graph can
    record it): inputs ``[B, T]`` -> ``[max_docs + 1]``, the boundaries of the ``N`` documents,
    then ``B*T`` repeated (zero-length documents, which every mixer skips). Needs ``N <=
    max_docs`` (``document_count`` tells, on the host): starts past ``max_docs`` are dropped."""
    B, T = inputs.shape
    flat = _starts(inputs, eod_id).flatten()
    # Start i goes to slot (number of starts up to it) - 1; every other token to a spare slot.
    slot = torch.where(flat, flat.cumsum(0) - 1, torch.full_like(flat, max_docs + 1, dtype=torch.long))
    out = torch.full((max_docs + 2,), B * T, dtype=torch.long, device=inputs.device)
    out.scatter_(0, slot.clamp_max(max_docs + 1), torch.arange(B * T, device=inputs.device))
    return out[:max_docs + 1]


def document_count(inputs: torch.Tensor, eod_id: int) -> int:
    """How many documents ``document_cu_seqlens`` finds in inputs ``[B, T]`` (one host read)."""
    return int(_starts(inputs, eod_id).sum())


def max_documents(batch: int, seq_len: int) -> int:
    """The fixed document count a CUDA-graphed step pads its boundaries to: every row's
    documents when they average at least 64 tokens (one partial document at each row end).
    A batch with more runs eagerly, with its exact boundaries."""
    return batch * (seq_len // 64 + 1)


@dataclass(frozen=True)
class WindowDocuments:
    """``RunData.documents`` of a text run under ``data.document_mask``: windows ``[B, T+1]`` ->
    the cu_seqlens of their inputs (``window_documents``), exact; ``padded`` and ``fits`` are
    the fixed-shape form a CUDA-graphed step records and the host check that it holds them."""
    eod_id: int

    def __call__(self, windows: torch.Tensor) -> torch.Tensor:
        return window_documents(windows, self.eod_id)

    def padded(self, windows: torch.Tensor) -> torch.Tensor:
        """windows ``[B, T+1]`` -> ``[max_documents(B, T) + 1]`` (``document_cu_seqlens_padded``)."""
        B, T = windows.shape[0], windows.shape[1] - 1
        return document_cu_seqlens_padded(windows[:, :-1], self.eod_id, max_documents(B, T))

    def fits(self, windows: torch.Tensor) -> bool:
        """Whether ``padded`` holds every document of ``windows`` ``[B, T+1]`` (one host read)."""
        B, T = windows.shape[0], windows.shape[1] - 1
        return document_count(windows[:, :-1], self.eod_id) <= max_documents(B, T)
