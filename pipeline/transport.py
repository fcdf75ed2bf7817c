"""Static plan of which AttnRes blocks travel on each hop, and the byte volumes it implies.

Hop ``c`` is the edge chunk c -> chunk c+1 (from rank ``c % P`` to rank ``(c+1) % P``). Its
forward message is ``[hidden] + [blocks[b] for b in plan.hops[c]]`` (hidden only when the
chunk's output hidden is not None); its backward message carries the gradients of exactly
those tensors, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("cached", "naive")


@dataclass(frozen=True)
class TransportPlan:
    """Per-hop and per-chunk block routing for one (produced_blocks, P, transport).

    hops[c]: block ids sent on hop c -> c+1 (len C-1).
    available[c]: block ids available after chunk c (chunk c+1's input blocks).
    from_cache[c]: input block ids chunk c takes from its rank's cache (cached transport).
    cache_after[c]: block ids chunk c puts in its rank's cache because a later chunk on the
        same rank reads them (received at c or produced by c); chunk c owns their gradient.
    """

    transport: str
    pp_size: int
    produced: tuple[tuple[int, ...], ...]
    hops: tuple[tuple[int, ...], ...]
    available: tuple[tuple[int, ...], ...]
    from_cache: tuple[tuple[int, ...], ...]
    cache_after: tuple[tuple[int, ...], ...]

    @property
    def num_chunks(self) -> int:
        return len(self.produced)

    def hop_blocks(self, c: int) -> tuple[int, ...]:
        return self.hops[c]


def build_plan(produced_blocks: list[list[int]], pp_size: int, transport: str = "cached") -> TransportPlan:
    """Route blocks for ``C = len(produced_blocks)`` chunks on ``pp_size`` ranks.

    naive: hop c carries ``available[c]`` (everything so far). cached: rank ``(c+1) % P``
    already holds ``available[c+1-P]`` (the output blocks of its previous chunk c+1-P, which are
    its inputs plus what it produced), so hop c carries ``available[c] - available[c+1-P]``:
    the blocks produced by the P-1 chunks c+2-P .. c.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    C = len(produced_blocks)
    seen: set[int] = set()
    available = []
    for c, prod in enumerate(produced_blocks):
        dup = seen.intersection(prod)
        if dup:
            raise ValueError(f"chunk {c} produces blocks {sorted(dup)} already produced earlier")
        seen.update(prod)
        available.append(tuple(sorted(seen)))
    hops, from_cache, cache_after = [], [()], []
    for c in range(C - 1):
        held = set(available[c + 1 - pp_size]) if transport == "cached" and c + 1 - pp_size >= 0 else set()
        hops.append(tuple(b for b in available[c] if b not in held))
        from_cache.append(tuple(sorted(held)))
    for c in range(C):
        later_local = transport == "cached" and c + pp_size < C
        own = set(produced_blocks[c]) | (set(hops[c - 1]) if c > 0 else set())
        cache_after.append(tuple(sorted(own)) if later_local else ())
    return TransportPlan(transport, pp_size, tuple(tuple(p) for p in produced_blocks), tuple(hops),
                         tuple(available), tuple(from_cache), tuple(cache_after))


def predicted_bytes(plan: TransportPlan, block_bytes: int, hidden_bytes: int, num_microbatches: int,
                    has_hidden: list[bool] | None = None) -> dict:
    """Forward bytes per step implied by the plan (the backward message mirrors it exactly).

    block_bytes: bytes of one ``[B, T, D]`` block tensor; hidden_bytes: of one hidden tensor.
    has_hidden[c]: whether hop c carries a hidden tensor (default: every hop).
    Returns ``{"per_hop": [{"hop", "blocks", "block_bytes", "hidden_bytes"}], "block_bytes",
    "hidden_bytes", "total_fwd", "total_fwd_bwd"}``.
    """
    C = plan.num_chunks
    has_hidden = has_hidden if has_hidden is not None else [True] * (C - 1)
    per_hop = []
    for c in range(C - 1):
        nb = len(plan.hops[c]) * block_bytes * num_microbatches
        nh = (hidden_bytes if has_hidden[c] else 0) * num_microbatches
        per_hop.append({"hop": c, "blocks": list(plan.hops[c]), "block_bytes": nb, "hidden_bytes": nh})
    blocks = sum(h["block_bytes"] for h in per_hop)
    hidden = sum(h["hidden_bytes"] for h in per_hop)
    return {"per_hop": per_hop, "block_bytes": blocks, "hidden_bytes": hidden,
            "total_fwd": blocks + hidden, "total_fwd_bwd": 2 * (blocks + hidden)}


def naive_volume(pp_size: int, vpp_size: int, blocks_per_chunk: int, block_bytes: int) -> int:
    """Naive transport: ``C(C-1)/2 * Np * d`` block bytes per microbatch (docs/attnres.md#the-byte-count).

    Exact for uniform Np: hop c carries the (c+1)*Np blocks made by chunks 0..c.
    """
    C = pp_size * vpp_size
    return C * (C - 1) // 2 * blocks_per_chunk * block_bytes


def cached_volume_k3(pp_size: int, vpp_size: int, blocks_per_chunk: int, block_bytes: int) -> int:
    """Cached transport, the commonly quoted upper bound (docs/attnres.md#the-byte-count):
    ``P(P-1)/2 * Np * d + (V-1) * P^2 * Np * d`` block bytes per microbatch.

    Exact count for uniform Np (see :func:`cached_volume_exact`):
    ``P(P-1)/2 * Np * d + (V-1) * P * (P-1) * Np * d``. The first virtual stage is the same in
    both (hop c < P-1 carries the (c+1)*Np blocks of chunks 0..c; the P-1 hops sum to
    P(P-1)/2 * Np). After it, each of the (V-1)*P remaining hops carries only the blocks of the
    P-1 chunks the receiver has not run since its own previous chunk (c+2-P .. c): its own
    previous chunk c+1-P's output is already in its cache. The K3 form counts P chunks' worth
    per such hop, over-counting by ``(V-1) * P * Np * d``.
    """
    P, V = pp_size, vpp_size
    return (P * (P - 1) // 2 + (V - 1) * P * P) * blocks_per_chunk * block_bytes


def cached_volume_exact(pp_size: int, vpp_size: int, blocks_per_chunk: int, block_bytes: int) -> int:
    """Exact cached block bytes per microbatch for uniform Np: ``(P(P-1)/2 + (V-1)P(P-1)) Np d``."""
    P, V = pp_size, vpp_size
    return (P * (P - 1) // 2 + (V - 1) * P * (P - 1)) * blocks_per_chunk * block_bytes


def closed_form_volume(transport: str, pp_size: int, vpp_size: int, blocks_per_chunk: int,
                       block_bytes: int) -> int:
    """The quoted closed form for ``transport`` (block bytes per microbatch, forward):
    naive, or the cached upper bound; docs/attnres.md#the-byte-count derives both."""
    fn = naive_volume if transport == "naive" else cached_volume_k3
    return fn(pp_size, vpp_size, blocks_per_chunk, block_bytes)
