"""Document masking in the mixers: a packed batch (several documents per row, ``cu_seqlens``)
gives, token for token, what each document gives run alone, and so do the gradients.

Reference: each document as its own ``[1, L]`` sequence through the unmasked op (its own code
path: F.conv1d, the chunked KDA from a zero state, causal SDPA). fp64; tolerance rtol = atol =
1e-10 (the two sides differ only by summation order, ~1e-15 observed).
"""
from __future__ import annotations

import pytest
import torch

from k3train.ops import documents
from k3train.model.kda_layer import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from k3train.ops.documents import document_ids, positions_in_document, same_document_causal_mask
from k3train.ops.kda import kda_gated, naive_recurrent_kda
from k3train.ops.short_conv import short_conv_silu

F64 = dict(dtype=torch.float64)
TIGHT = dict(rtol=1e-10, atol=1e-10)
# Two rows of 13 tokens: row 0 holds documents of 5, 1 and 7 tokens, row 1 of 9 and 4.
LENGTHS = [[5, 1, 7], [9, 4]]
B, T = 2, 13
CU = torch.tensor([0, 5, 6, 13, 22, 26])


def _docs():
    """(row, start, end) of every document, in cu_seqlens order."""
    out = []
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            out.append((row, start, start + n))
            start += n
    return out


def _each_alone(fn, *tensors):
    """fn on each document alone ([1, L, ...] slices), scattered back to [B, T, ...]."""
    out = None
    for row, lo, hi in _docs():
        y = fn(*(t[row:row + 1, lo:hi] for t in tensors))
        if out is None:
            out = y.new_zeros(B, T, *y.shape[2:])
        out[row:row + 1, lo:hi] = y
    return out


def test_helpers_match_the_documents():
    ids = document_ids(CU, B, T)
    want_ids = torch.zeros(B, T, dtype=torch.long)
    want_pos = torch.zeros(B, T, dtype=torch.long)
    for n, (row, lo, hi) in enumerate(_docs()):
        want_ids[row, lo:hi] = n
        want_pos[row, lo:hi] = torch.arange(hi - lo)
    assert torch.equal(ids, want_ids) and torch.equal(positions_in_document(CU, B, T), want_pos)
    mask = same_document_causal_mask(CU, B, T)
    assert mask.shape == (B, 1, T, T)
    for b in range(B):
        for t in range(T):
            for s in range(T):
                assert bool(mask[b, 0, t, s]) == (s <= t and want_ids[b, t] == want_ids[b, s])


def _grads(out, *leaves, seed=7):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), **F64)
    return torch.autograd.grad((out * w).sum(), leaves)


def test_short_conv_restarts_at_each_document():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, 6, generator=gen, **F64).requires_grad_()
    w = torch.randn(6, 4, generator=gen, **F64).requires_grad_()
    packed = short_conv_silu(x, w, CU)
    alone = _each_alone(lambda xs: short_conv_silu(xs, w), x)
    torch.testing.assert_close(packed, alone, **TIGHT)
    for a, b in zip(_grads(packed, x, w), _grads(alone, x, w)):
        torch.testing.assert_close(a, b, **TIGHT)
    # and the mask does something: without it the 2nd document's first token sees the 1st's
    assert (short_conv_silu(x, w)[0, 5] - packed[0, 5]).abs().max() > 1e-3


def test_kda_state_restarts_at_each_document():
    gen = torch.Generator().manual_seed(1)
    H, K = 2, 4
    q, k, v, f = (torch.randn(B, T, H, K, generator=gen, **F64).requires_grad_() for _ in range(4))
    bl = torch.randn(B, T, H, generator=gen, **F64).requires_grad_()
    A_log, dt_bias = torch.randn(H, generator=gen, **F64), torch.randn(H, K, generator=gen, **F64)
    packed = kda_gated(q, k, v, f, bl, A_log, dt_bias, -5.0, cu_seqlens=CU)
    alone = _each_alone(lambda *t: kda_gated(*t, A_log, dt_bias, -5.0), q, k, v, f, bl)
    torch.testing.assert_close(packed, alone, **TIGHT)
    for a, b in zip(_grads(packed, q, k, v, f, bl), _grads(alone, q, k, v, f, bl)):
        torch.testing.assert_close(a, b, **TIGHT)
    # the token-by-token oracle with the state zeroed at each start agrees too
    g = -5.0 * torch.sigmoid(torch.exp(A_log)[:, None] * (f + dt_bias))
    norm = lambda t: t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    oracle = _each_alone(lambda *t: naive_recurrent_kda(norm(t[0]), norm(t[1]), t[2], t[3], torch.sigmoid(t[4]))[0],
                         q, k, v, g, bl)
    torch.testing.assert_close(packed, oracle, **TIGHT)


def _must_not_build_the_mask(*args):
    raise AssertionError("the per-document path built the dense mask")


@pytest.mark.parametrize("attention", ["dense_mask", "per_document"])
def test_kda_layer_and_mla_match_documents_alone(world1, monkeypatch, attention):
    # MLA's two ways to mask (k3train.ops.documents.document_attention), each forced: one SDPA
    # call with the [B, 1, T, T] mask, or a causal call per document that never builds the mask.
    if attention == "per_document":
        monkeypatch.setattr(documents, "PER_DOCUMENT_MIN_WINDOW", 1)
        monkeypatch.setattr(documents, "same_document_causal_mask", _must_not_build_the_mask)
    else:
        monkeypatch.setattr(documents, "PER_DOCUMENT_MIN_WINDOW", 10 ** 9)
    torch.manual_seed(0)
    kda = KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=8, conv_size=4, chunk_size=4, std=0.3).double()
    mla = GatedMLA(hidden_size=16, num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                   qk_rope_head_dim=3, v_head_dim=5, std=0.3).double()
    for layer in (kda, mla):
        x = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(2), **F64).requires_grad_()
        params = [p for p in layer.parameters() if p.requires_grad]
        packed = layer(x, CU)
        alone = _each_alone(layer, x)
        torch.testing.assert_close(packed, alone, **TIGHT)
        for a, b in zip(_grads(packed, x, *params), _grads(alone, x, *params)):
            torch.testing.assert_close(a, b, **TIGHT)
        assert (layer(x)[0, 6:] - packed[0, 6:]).abs().max() > 1e-4   # unmasked differs
