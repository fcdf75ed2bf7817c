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

import torch

__all__ = ["document_cu_seqlens", "window_documents"]


def document_cu_seqlens(inputs: torch.Tensor, eod_id: int) -> torch.Tensor:
    """inputs ``[B, T]`` -> cu_seqlens ``[N+1]`` (int64, on inputs' device): the flat index of
    every row start and every EOD token, then ``B*T``."""
    B, T = inputs.shape
    starts = inputs == eod_id
    starts[:, 0] = True
    idx = starts.flatten().nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([B * T])])


def window_documents(windows: torch.Tensor, eod_id: int) -> torch.Tensor:
    """windows ``[B, T+1]`` -> the cu_seqlens of their inputs ``windows[:, :-1]``."""
    return document_cu_seqlens(windows[:, :-1], eod_id)
