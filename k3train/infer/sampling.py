"""Sampling the next token on the device, from counter-based noise: no host round trip, no RNG state.

``sample_tokens(logits, temperature, top_p, seed, counter)`` draws by the Gumbel-max trick:
``argmax(logits / temperature + G)`` with ``G = -log(-log(U))`` over the tokens the nucleus
(top-p) filter keeps is a draw from the renormalised softmax over them. ``U`` is not read from a
generator: it is a hash of (seed, counter, row, token id) computed with integer tensor ops, so

* a CUDA-graphed decode step can draw it inside the graph (``counter`` is a device tensor the
  step advances in place; nothing is read on the host and no generator state must be
  registered with the graph);
* the same seed gives the same draws eagerly and replayed, on CPU and CUDA (integer arithmetic
  is exact; only the logits' rounding can differ between devices).

The hash is a 32-bit integer mixer (xor-shift-multiply rounds) kept in int64 with every product
below 2**63, so no tensor op overflows. Temperature 0 is greedy (argmax, no noise).
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of the int64 tensor ``x`` (values in [0, 2**32)), same shape.
    Multipliers below 2**31 keep every product below 2**63 (no int64 overflow)."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 16)) * 0x297A2D39) & _M32
    return x ^ (x >> 16)


def uniform_noise(shape: tuple[int, int], seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` fp32 uniforms in (0, 1), a pure function of (seed, counter, position): seed and
    counter are int64 tensors (0-dim) on the device the noise is made on."""
    B, V = shape
    key = _mix32(_mix32(seed & _M32) ^ (counter & _M32))  # []
    idx = torch.arange(B * V, device=seed.device, dtype=torch.int64).view(B, V)
    x = _mix32((_mix32(idx ^ key) + key) & _M32)
    # 24 bits: exact in fp32; the half step keeps 0 and 1 out (log(0) below).
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """logits ``[B, V]`` -> next token ids ``[B]`` int64, on the logits' device.

    temperature 0: greedy. Else a draw from ``softmax(logits / temperature)`` restricted to the
    smallest set of most probable tokens whose mass reaches ``top_p`` (the most probable token
    always stays; ``top_p=1`` keeps every token), keyed by (``seed``, ``counter``): 0-dim int64
    tensors on the logits' device. Fixed shapes and no host synchronisation."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    if top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(tuple(logits.shape), seed, counter)))
    return (scaled + gumbel).argmax(-1)
