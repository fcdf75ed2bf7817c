import itertools

import pytest

from pipeline import (build_plan, cached_volume_exact, cached_volume_k3, naive_volume,
                      predicted_bytes)


def uniform(C, Np):
    """Chunk c produces Np consecutive block ids (chunk 0's first is the embedding, block 0)."""
    return [list(range(c * Np, (c + 1) * Np)) for c in range(C)]


def irregular(C):
    """Blocks of 2 layers over an uneven layer split: some chunks produce none, some two."""
    out, nxt = [], 0
    for c in range(C):
        k = (c * 7 + 3) % 3
        out.append(list(range(nxt, nxt + k)))
        nxt += k
    out[0] = [0] + [b + 1 for b in out[0]]
    return [out[0]] + [[b + 1 for b in o] for o in out[1:]]


GRIDS = [(P, V) for P, V in itertools.product([1, 2, 3, 4], [1, 2, 3])]


def _holdings(plan, P):
    """Replay the cached protocol: blocks each rank holds before each chunk (one microbatch)."""
    held = {r: set() for r in range(P)}
    sent = {r: [] for r in range(P)}
    for c in range(plan.num_chunks):
        r = c % P
        if c > 0:
            hop = set(plan.hops[c - 1])
            assert not hop & held[r], f"hop {c-1} sends {hop & held[r]} that rank {r} holds"
            sent[r] += list(hop)
            held[r] |= hop
            assert held[r] >= set(plan.available[c - 1]), "chunk input incomplete"
        held[r] |= set(plan.produced[c])
    return sent


@pytest.mark.parametrize("P,V", GRIDS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", ["uniform1", "uniform2", "irregular"])
def test_plans(P, V, shape):
    C = P * V
    produced = {"uniform1": uniform(C, 1), "uniform2": uniform(C, 2), "irregular": irregular(C)}[shape]
    naive, cached = build_plan(produced, P, "naive"), build_plan(produced, P, "cached")
    for c in range(C - 1):
        assert naive.hops[c] == naive.available[c]        # naive carries everything so far
    sent = _holdings(cached, P)
    for r, blocks in sent.items():                        # each block reaches a rank at most once
        assert len(blocks) == len(set(blocks))
    n_naive = sum(map(len, naive.hops))
    n_cached = sum(map(len, cached.hops))
    if V > 1 and P > 1 and any(produced[:-1]):
        assert n_cached < n_naive
    assert n_cached <= n_naive


@pytest.mark.parametrize("P,V", GRIDS, ids=lambda v: str(v))
@pytest.mark.parametrize("Np", [1, 2])
def test_volumes_match_closed_forms(P, V, Np):
    C, d, m = P * V, 1024, 3
    naive = predicted_bytes(build_plan(uniform(C, Np), P, "naive"), d, d, m)
    cached = predicted_bytes(build_plan(uniform(C, Np), P, "cached"), d, d, m)
    assert naive["block_bytes"] == m * naive_volume(P, V, Np, d)
    assert cached["block_bytes"] == m * cached_volume_exact(P, V, Np, d)
    assert cached["block_bytes"] <= m * cached_volume_k3(P, V, Np, d)
    # The K3 form over-counts by exactly one chunk's blocks per hop after the first stage.
    assert cached_volume_k3(P, V, Np, d) - cached_volume_exact(P, V, Np, d) == (V - 1) * P * Np * d
    assert naive["hidden_bytes"] == m * (C - 1) * d


def test_predicted_bytes_without_hidden():
    plan = build_plan(uniform(4, 1), 2, "cached")
    p = predicted_bytes(plan, 100, 10, 2, has_hidden=[True, False, True])
    assert p["hidden_bytes"] == 2 * 2 * 10
    assert [h["blocks"] for h in p["per_hop"]] == [[0], [1], [2]]


def test_bad_inputs():
    with pytest.raises(ValueError, match="transport must be one of"):
        build_plan(uniform(2, 1), 2, "zero-copy")
    with pytest.raises(ValueError, match="already produced"):
        build_plan([[0, 1], [1]], 2)
