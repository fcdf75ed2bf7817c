"""Context-parallel primitives against the single-process full-sequence computation.

Single-process tests check the algebra the fold rests on (linearity in the initial state, the
chained fold equals a sequential run) and the accounting; the gloo tests split one fp64 sequence
over 2 and 4 local processes and compare every output and every input gradient to the full
sequence (``naive_recurrent_kda``, ``short_conv_silu_torch``, SDPA with ``is_causal``) to 1e-10,
and the bytes each rank logged to ``cp_bytes_per_rank``.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3train.ops.context_parallel import (
    CPCommLog, CPShapeError, causal_pairs_per_rank, cp_bytes_per_rank, cp_pieces, cp_token_index, fold_kda_states,
    _fold_and_correct, kda_chunks_folded, kda_cp, kda_local_states, mla_attention_cp, piece_owner, short_conv_cp,
)
from k3train.config import load_config
from k3train.model.flops import flops_breakdown
from k3train.ops.kda import chunk_kda_torch, kda_gated, kda_gated_state, naive_recurrent_kda
from k3train.ops.short_conv import short_conv_silu_torch
from tests.multiproc import run_multiprocess

TOL = dict(rtol=0, atol=1e-10)
PAGE = (Path(__file__).resolve().parents[2] / "docs" / "long_context.md").read_text()
B, H, K, V, TL, W = 2, 2, 4, 3, 6, 4  # V != K catches a transposed state
R, ROPE, NOPE, VD = 5, 2, 3, 3  # MLA latent rank, shared key dim, per-head nope and value dims


def _kda_inputs(T: int, seed: int = 0, requires_grad: bool = True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    g = -F.softplus(r(B, T, H, K)) * 0.3  # decays in (0.5, 1): state carries across ranks
    beta = torch.sigmoid(r(B, T, H))
    out = [q, k, v, g, beta]
    return [x.requires_grad_(requires_grad) for x in out]


def _grads(loss, xs):
    return torch.autograd.grad(loss, xs, allow_unused=True)


# --------------------------------------------------------------------------- one process


def test_local_states_are_linear_in_the_initial_state():
    """o(S0) = o0 + q~ S0 and S_end(S0) = M S0 + E, against the recurrence run from S0."""
    q, k, v, g, beta = _kda_inputs(9, requires_grad=False)
    S0 = torch.randn(B, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o0, qt, E, M = kda_local_states(q, k, v, g, beta, kernel=naive_recurrent_kda)
    torch.testing.assert_close(o0 + torch.einsum("bthk,bhkv->bthv", qt, S0), o_ref, **TOL)
    torch.testing.assert_close(torch.einsum("bhkl,bhlv->bhkv", M, S0) + E, s_ref, **TOL)


def test_fold_equals_running_the_chunks_in_sequence():
    q, k, v, g, beta = _kda_inputs(4 * TL, requires_grad=False)
    chunks = [[x[:, i * TL:(i + 1) * TL] for x in (q, k, v, g, beta)] for i in range(4)]
    states = [kda_local_states(*c, kernel=chunk_kda_torch)[2:] for c in chunks]
    E_all = torch.stack([e for e, _ in states])
    M_all = torch.stack([m for _, m in states])
    S = None
    for r in range(4):
        S_fold = fold_kda_states(E_all, M_all, r)
        expected = torch.zeros_like(S_fold) if S is None else S
        torch.testing.assert_close(S_fold, expected, **TOL)
        _, S = naive_recurrent_kda(*chunks[r], initial_state=S, output_final_state=True)


def test_fold_and_correction_ignore_bf16_autocast():
    """The fold's state chain and the output correction run in the states' fp32 under bf16
    autocast too (bitwise the same as without autocast): autocast would round every product's
    operands to bf16 (the GPU trainer's steps run under it)."""
    gen = torch.Generator().manual_seed(7)
    E_all = torch.randn(4, B, H, K, V, generator=gen)
    M_all = torch.randn(4, B, H, K, K, generator=gen) * 0.5
    o0, q_tilde = torch.randn(B, TL, H, V, generator=gen), torch.randn(B, TL, H, K, generator=gen)
    plain = [fold_kda_states(E_all, M_all, 3), _fold_and_correct(o0, q_tilde, E_all, M_all, 3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = [fold_kda_states(E_all, M_all, 3), _fold_and_correct(o0, q_tilde, E_all, M_all, 3)]
    for a, b in zip(under, plain):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_chunks_folded_on_one_device_equal_the_whole_sequence():
    """The one-device form of the fold (what the GPU check runs): output and input gradients."""
    full = _kda_inputs(3 * TL)
    w_o = torch.randn(B, 3 * TL, H, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o_ref, _ = naive_recurrent_kda(*full)
    o = kda_chunks_folded(*full, num_chunks=3, kernel=chunk_kda_torch)
    torch.testing.assert_close(o, o_ref, **TOL)
    for got, want in zip(_grads((o * w_o).sum(), full), _grads((o_ref * w_o).sum(), full)):
        torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(CPShapeError, match="do not split into 4 equal chunks"):
        kda_chunks_folded(*full, num_chunks=4)


def test_the_layers_gated_kernel_plugs_in_through_an_adapter():
    """The KDA layer's own call (raw q, k, gate pre-activation, beta logits; fla's in-kernel gate
    on CUDA) as the fold's kernel: the fold slices every tensor along time and passes the state
    arguments, so an adapter over ``kda_gated_state`` serves, and equals ``kda_gated`` whole."""
    gen = torch.Generator().manual_seed(6)
    q, k, f = (torch.randn(B, 3 * TL, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.randn(B, 3 * TL, H, V, generator=gen, dtype=torch.float64)
    b_logits = torch.randn(B, 3 * TL, H, generator=gen, dtype=torch.float64)
    A_log, dt_bias = torch.randn(H, generator=gen, dtype=torch.float64), torch.randn(H, K, generator=gen, dtype=torch.float64)

    def gated(q, k, v, f, b, scale=None, initial_state=None, output_final_state=False):
        return kda_gated_state(q, k, v, f, b, A_log, dt_bias, -5.0, initial_state=initial_state,
                               output_final_state=output_final_state)

    o = kda_chunks_folded(q, k, v, f, b_logits, num_chunks=3, kernel=gated)
    torch.testing.assert_close(o, kda_gated(q, k, v, f, b_logits, A_log, dt_bias, -5.0), **TOL)


def _mb(x: float) -> str:
    return f"{x / 1e6:.0f}" if x >= 100e6 else f"{x / 1e6:.3g}"


def test_docs_byte_table_is_the_formula():
    for P in (2, 4, 8, 16):
        row = [cp_bytes_per_rank(cp=P, rank=1, batch=1, local_tokens=N // P, kda_heads=96, kda_head_dim=128,
                                 conv_channels=3 * 96 * 128, mla_latent_dim=576) for N in (1 << 17, 1 << 20)]
        text = f"| {P} | {_mb(row[0]['kda_fwd'])} | {_mb(row[0]['conv_bwd'])} | {_mb(row[0]['mla_fwd'])} | {_mb(row[1]['mla_fwd'])} |"
        assert text in PAGE, text


def test_docs_partition_table_is_the_flop_count():
    """Slowest rank over the mean for k3_full's training FLOPs: per-token work is balanced, MLA's
    causal pairs follow ``causal_pairs_per_rank``."""
    cfg = load_config("configs/k3_full.yaml", [])
    for N, label in ((1 << 17, "128K"), (1 << 20, "1M")):
        f = flops_breakdown(cfg, N)
        per_pair = f["mla_attention"] * 2 / (N + 1)  # per token it is per_pair * (N + 1) / 2
        linear = f["total"] - f["mla_attention"]
        assert f"| {label} | {100 * f['mla_attention'] / f['total']:.1f}% | 2 |" in PAGE
        for P in (2, 4, 8, 16):
            pairs = causal_pairs_per_rank(N, P)
            work = [linear * N / P + per_pair * p for p in pairs]
            ratio_attn = max(pairs) / (sum(pairs) / P)
            ratio = max(work) / (sum(work) / P)
            assert f"| {P} | {ratio_attn:.2f} | {ratio:.2f} | 1.00 |" in PAGE, (label, P, ratio_attn, ratio)


def test_doc_start_inside_the_chunk_restarts_the_state():
    """With a document starting at local position 3: tokens before it see the carried state,
    tokens from it on do not, and the end state ignores the initial state (M = 0)."""
    q, k, v, g, beta = _kda_inputs(TL, requires_grad=False)
    o0, qt, E, M = kda_local_states(q, k, v, g, beta, kernel=naive_recurrent_kda, doc_starts=[3])
    assert M.abs().max() == 0 and qt[:, 3:].abs().max() == 0 and qt[:, :3].abs().max() > 0.1
    o_tail, s_tail = naive_recurrent_kda(*(x[:, 3:] for x in (q, k, v, g, beta)), output_final_state=True)
    torch.testing.assert_close(o0[:, 3:], o_tail, **TOL)
    torch.testing.assert_close(E, s_tail, **TOL)
    with pytest.raises(CPShapeError, match="doc_starts must lie in"):
        kda_local_states(q, k, v, g, beta, doc_starts=[TL])


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
@pytest.mark.parametrize("partition", ["contiguous", "head_tail"])
def test_causal_pairs_count_every_pair_once(cp, partition):
    """Pairs per rank against a brute-force count of the lower triangle by owner of the query."""
    n = 2 * cp * 3
    owner = torch.arange(n) // (n // cp) if partition == "contiguous" else torch.tensor(
        [min(p, 2 * cp - 1 - p) for p in (torch.arange(n) // (n // (2 * cp))).tolist()])
    brute = [int(((owner == r).long() * (torch.arange(n) + 1)).sum()) for r in range(cp)]
    assert causal_pairs_per_rank(n, cp, partition) == brute
    assert sum(brute) == n * (n + 1) // 2


@pytest.mark.parametrize("partition", ["contiguous", "head_tail"])
def test_the_ranks_token_indices_cover_the_sequence_once(partition):
    """cp_token_index over the ranks is a permutation of the positions; each rank's pieces are
    where piece_owner says (head-tail, P = 4: rank 1 holds pieces 1 and 6 = positions 3-5, 18-20)."""
    cp, N = 4, 24
    idx = [cp_token_index(N, r, cp, partition) for r in range(cp)]
    assert sorted(torch.cat(idx).tolist()) == list(range(N))
    for r in range(cp):
        assert [piece_owner(p, cp, partition) for p in cp_pieces(r, cp, partition)] == [
            (r, s) for s in range(len(cp_pieces(r, cp, partition)))]
    if partition == "head_tail":
        assert idx[1].tolist() == [3, 4, 5, 18, 19, 20]
    with pytest.raises(CPShapeError, match="divisible by 8"):
        cp_token_index(20, 0, cp, "head_tail")


def test_head_tail_balances_and_contiguous_does_not():
    contiguous = causal_pairs_per_rank(1 << 17, 8)
    head_tail = causal_pairs_per_rank(1 << 17, 8, "head_tail")
    assert max(contiguous) / (sum(contiguous) / 8) == pytest.approx(15 / 8, rel=1e-3)  # (2P-1)/P
    assert max(head_tail) / (sum(head_tail) / 8) == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(CPShapeError, match="divisible by 16"):
        causal_pairs_per_rank(100, 8, "head_tail")


def test_byte_formula_at_k3_widths():
    """The issue's number: one rank's [E, M] per layer is 96 x 128 x 256 fp32 = 12.6 MB."""
    b = cp_bytes_per_rank(cp=2, rank=0, batch=1, local_tokens=4096, kda_heads=96, kda_head_dim=128,
                          conv_channels=3 * 96 * 128, mla_latent_dim=576)
    assert b["kda_fwd"] == 96 * 128 * 256 * 4 == 12_582_912
    assert b["conv_fwd"] == 3 * 3 * 96 * 128 * 2 and b["conv_bwd"] == 0
    assert b["mla_fwd"] == 4096 * 576 * 2


# --------------------------------------------------------------------------- gloo ranks


def _expand_weights():
    gen = torch.Generator().manual_seed(11)
    w_up = torch.randn(H * (NOPE + VD), R - ROPE, generator=gen, dtype=torch.float64) * 0.5
    return w_up.requires_grad_(True)


def _expand(latent, w_up):
    """A small MLA up-projection: latent [B, S, R] -> k [B, S, H, NOPE + ROPE], v [B, S, H, VD]."""
    Bs, S, _ = latent.shape
    c, shared = latent.split([R - ROPE, ROPE], dim=-1)
    k_nope, v = (F.rms_norm(c, (R - ROPE,)) @ w_up.T).view(Bs, S, H, NOPE + VD).split([NOPE, VD], dim=-1)
    return torch.cat([k_nope, shared.unsqueeze(2).expand(Bs, S, H, ROPE)], dim=-1), v


def _check(name, got, want):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def _cp_group(world, cp):
    """The CP group of this process: consecutive ranks in groups of ``cp`` (the world when cp is
    the world size, else one group per data-parallel replica), and its index."""
    if cp == world:
        return None, 0
    groups = [dist.new_group(list(range(i, i + cp))) for i in range(0, world, cp)]  # all ranks create all
    index = dist.get_rank() // cp
    return groups[index], index


def _primitives_body(world_rank, world, cp, partition):
    group, replica = _cp_group(world, cp)
    rank = dist.get_rank(group)
    T = cp * TL
    sl = cp_token_index(T, rank, cp, partition)  # this rank's global positions, in local order
    log = CPCommLog()
    gen = torch.Generator().manual_seed(3 + replica)  # each replica its own sequence

    # KDA: output and the gradient of every input
    full = _kda_inputs(T, seed=replica)
    w_o = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    o_ref, _ = naive_recurrent_kda(*full)
    ref = _grads((o_ref * w_o).sum(), full)
    local = [x.detach()[:, sl].clone().requires_grad_(True) for x in full]
    o = kda_cp(*local, group=group, kernel=chunk_kda_torch, log=log, partition=partition)
    _check("kda o", o, o_ref.detach()[:, sl])
    for name, got, want in zip("q k v g beta".split(), _grads((o * w_o[:, sl]).sum(), local), ref):
        _check(f"kda d{name}", got, want[:, sl])

    # short conv: output, input gradient, weight gradient summed over ranks
    x = torch.randn(B, T, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, W, generator=gen, dtype=torch.float64, requires_grad=True)
    w_y = torch.randn(B, T, 5, generator=gen, dtype=torch.float64)
    y_ref = short_conv_silu_torch(x, w)
    dx_ref, dw_ref = _grads((y_ref * w_y).sum(), [x, w])
    xl = x.detach()[:, sl].clone().requires_grad_(True)
    y = short_conv_cp(xl, w, group=group, conv=short_conv_silu_torch, log=log, partition=partition)
    _check("conv y", y, y_ref.detach()[:, sl])
    dx, dw = _grads((y * w_y[:, sl]).sum(), [xl, w])
    dist.all_reduce(dw, group=group)
    _check("conv dx", dx, dx_ref[:, sl])
    _check("conv dweight", dw, dw_ref)

    # MLA attention core: queries, latent and up-projection weight
    q = torch.randn(B, T, H, NOPE + ROPE, generator=gen, dtype=torch.float64, requires_grad=True)
    lat = torch.randn(B, T, R, generator=gen, dtype=torch.float64, requires_grad=True)
    w_up = _expand_weights()
    w_a = torch.randn(B, T, H, VD, generator=gen, dtype=torch.float64)
    kf, vf = _expand(lat, w_up)
    a_ref = F.scaled_dot_product_attention(q.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2),
                                           is_causal=True).transpose(1, 2)
    dq_ref, dlat_ref, dw_ref = _grads((a_ref * w_a).sum(), [q, lat, w_up])
    ql, latl = (t.detach()[:, sl].clone().requires_grad_(True) for t in (q, lat))
    a = mla_attention_cp(ql, latl, lambda z: _expand(z, w_up), group=group, log=log, partition=partition)
    _check("mla out", a, a_ref.detach()[:, sl])
    dq, dlat, dw = _grads((a * w_a[:, sl]).sum(), [ql, latl, w_up])
    dist.all_reduce(dw, group=group)
    _check("mla dq", dq, dq_ref[:, sl])
    _check("mla dlatent", dlat, dlat_ref[:, sl])
    _check("mla dweight", dw, dw_ref)

    # Bytes this rank sent, per op and direction, against the formula (fp64: 8 bytes each)
    want = cp_bytes_per_rank(cp=cp, rank=rank, batch=B, local_tokens=TL, kda_heads=H, kda_head_dim=K,
                             kda_value_dim=V, conv_channels=5, conv_width=W, mla_latent_dim=R,
                             state_bytes=8, act_bytes=8, partition=partition)
    got = {f"{tag}_{d}": log.total(tag, d) for tag in ("kda", "conv", "mla") for d in ("fwd", "bwd")}
    assert got == want, (got, want)


def _doc_flag_body(rank, cp, partition):
    """Hand-built document masking: documents start at global positions 0, a rank boundary
    (contiguous: rank 1's first token; head-tail: the first token of piece 2) and inside the
    last rank's chunk (head-tail: inside a piece); each document run alone is the reference, for
    outputs and input gradients."""
    T = cp * TL
    sl = cp_token_index(T, rank, cp, partition)
    starts = [0, TL, (cp - 1) * TL + 2]
    full = _kda_inputs(T, seed=7)
    w_o = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    bounds = starts + [T]
    o_ref = torch.cat([naive_recurrent_kda(*(x[:, a:b] for x in full))[0]
                       for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    ref = _grads((o_ref * w_o).sum(), full)
    local = [x.detach()[:, sl].clone().requires_grad_(True) for x in full]
    mine = [i for i, pos in enumerate(sl.tolist()) if pos in starts]
    o = kda_cp(*local, kernel=chunk_kda_torch, doc_starts=mine, partition=partition)
    _check("doc kda o", o, o_ref.detach()[:, sl])
    for name, got, want in zip("q k v g beta".split(), _grads((o * w_o[:, sl]).sum(), local), ref):
        _check(f"doc kda d{name}", got, want[:, sl])

    # conv: the document starting at rank 1's first token must not see rank 0's tokens
    x = torch.randn(B, T, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64,
                    requires_grad=True)
    w = torch.randn(5, W, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    y_ref = torch.cat([short_conv_silu_torch(x[:, :TL], w), short_conv_silu_torch(x[:, TL:], w)], dim=1)
    (dx_ref,) = _grads(y_ref.sum(), [x])
    xl = x.detach()[:, sl].clone().requires_grad_(True)
    n = TL // len(cp_pieces(rank, cp, partition))
    flags = [p * n == TL for p in cp_pieces(rank, cp, partition)]  # a piece that starts at TL
    y = short_conv_cp(xl, w, conv=short_conv_silu_torch, doc_start_at_first_token=flags, partition=partition)
    _check("doc conv y", y, y_ref.detach()[:, sl])
    _check("doc conv dx", _grads(y.sum(), [xl])[0], dx_ref[:, sl])


@pytest.mark.slow
@pytest.mark.parametrize("world, cp, partition", [(2, 2, "contiguous"), (4, 4, "contiguous"), (4, 2, "contiguous"),
                                                  (2, 2, "head_tail"), (4, 4, "head_tail"), (4, 2, "head_tail")],
                         ids=["cp2", "cp4", "dp2xcp2", "cp2-head_tail", "cp4-head_tail", "dp2xcp2-head_tail"])
def test_primitives_match_the_full_sequence(world, cp, partition):
    """dp2xcp2: two CP groups of two in one world of four (process subgroups), each its own
    sequence: the ops address their peers by group rank. head_tail: each rank holds pieces r
    and 2P - 1 - r of 2P (the KDA fold over 2P pieces, two halos per rank, one from itself on
    rank P - 1, the latent put back in sequence order)."""
    run_multiprocess(_primitives_body, world, cp, partition)


@pytest.mark.slow
@pytest.mark.parametrize("partition", ["contiguous", "head_tail"])
@pytest.mark.parametrize("cp", [2, 4])
def test_document_starts_stop_the_carried_state(cp, partition):
    run_multiprocess(_doc_flag_body, cp, partition)
