"""Batched decoding with every piece of state in static buffers, eager or replayed from a CUDA graph.

``Decoder(cached, vocab=..., cuda_graph=...)`` generates for a batch of prompts (of any lengths):

1. **Prefill** (eager, chunked): the prompts are grouped by length and each group runs the
   growing-cache forward of ``CachedModel`` (fla's chunked KDA, causal latent attention); its
   caches are copied into the rows of the batch's ``DecodeBuffers``.
2. **Decode**: one step per token reads the token and each sequence's position from static
   device tensors, runs the model's static-buffer forward (``CachedKDA._forward_static``,
   ``CachedMLA._forward_static``: in-place updates of the KDA state, the short-conv tails and
   the fixed-length latent cache), writes the logits, samples the next token on the device
   (``k3train.infer.sampling``) and advances the positions and the noise counter, all in place.
   ``GraphedDecoder`` captures that step once per batch size (and sampling settings) and
   replays it; with graphs off (CPU, ``--cuda-graph false``) the same step runs eagerly.

The tokens stay on the device until the end: one host read per ``generate`` call.
Sequences of different lengths share the step: the latent cache is ``max_len`` slots long for
every row, each row masks the slots after its own position, and the KDA layers keep no
position at all.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from k3train.infer.cache import CachedKDA, CachedMLA, CachedModel
from k3train.infer.graphed import CudaGraphs, GraphedDecoder
from k3train.infer.sampling import sample_tokens

# The latent cache's length is rounded up to this many slots, so that generate calls of
# similar lengths reuse one set of buffers (and its graph) instead of reallocating.
LENGTH_STEP = 256


@dataclass(eq=False)
class DecodeBuffers:
    """The static state of decoding ``batch`` sequences of at most ``max_len`` tokens.

    token ``[B]`` int64: the token the next step feeds (the last one sampled);
    pos ``[B]`` int64: the position that token takes (the tokens each sequence holds so far);
    logits ``[B, vocab]``: the last logits (prefill's last position, then each step's);
    seed, counter: 0-dim int64, the sampling noise's key (``sample_tokens``);
    layers: per mixer of the model, its buffers (``CachedKDA``: ``S`` [B, H, K, V] and the
    tails ``q``/``k``/``v`` [B, W-1, H*K]; ``CachedMLA``: ``c`` [B, L, rank], ``k_rope``
    [B, L, rope] and ``pos``, the same tensor as above), None for a mixer without a cache.
    """

    batch: int
    max_len: int
    token: torch.Tensor
    pos: torch.Tensor
    logits: torch.Tensor
    seed: torch.Tensor
    counter: torch.Tensor
    layers: list[dict[str, torch.Tensor] | None]

    @classmethod
    def like(cls, cached: CachedModel, batch: int, max_len: int, logits: torch.Tensor) -> "DecodeBuffers":
        """Zeroed buffers shaped after the caches a prefill left in ``cached``'s mixers and its
        last logits ``[b, vocab]`` (dtypes and widths as the prefill made them)."""
        dev = logits.device
        pos = torch.zeros(batch, dtype=torch.int64, device=dev)
        layers: list[dict[str, torch.Tensor] | None] = []
        for mixer in cached.mixers:
            if isinstance(mixer, (CachedKDA, CachedMLA)):
                bufs = {}
                for key, t in mixer.cache.items():
                    shape = list(t.shape)
                    shape[0] = batch
                    if isinstance(mixer, CachedMLA):
                        shape[1] = max_len
                    bufs[key] = torch.zeros(shape, dtype=t.dtype, device=dev)
                if isinstance(mixer, CachedMLA):
                    bufs["pos"] = pos
                layers.append(bufs)
            else:
                layers.append(None)
        return cls(batch=batch, max_len=max_len, token=torch.zeros(batch, dtype=torch.int64, device=dev),
                   pos=pos, logits=torch.zeros(batch, logits.shape[-1], dtype=logits.dtype, device=dev),
                   seed=torch.zeros((), dtype=torch.int64, device=dev),
                   counter=torch.zeros((), dtype=torch.int64, device=dev), layers=layers)

    @torch.no_grad()
    def load(self, cached: CachedModel, rows: list[int], logits: torch.Tensor) -> None:
        """Copy the caches of a prefill of ``len(rows)`` sequences of one length (in ``cached``'s
        mixers) into ``rows``, and their last logits ``[len(rows), vocab]``."""
        idx = torch.tensor(rows, dtype=torch.int64, device=self.token.device)
        length = cached.length
        for mixer, bufs in zip(cached.mixers, self.layers):
            if bufs is None:
                continue
            for key, t in mixer.cache.items():
                if isinstance(mixer, CachedMLA):
                    # Slots past the prompt are zeroed: masked slots must hold finite numbers.
                    bufs[key][idx] = 0
                    bufs[key][idx, :length] = t
                else:
                    bufs[key][idx] = t
        self.pos[idx] = length
        self.logits[idx] = logits


def bind(cached: CachedModel, buffers: DecodeBuffers | None) -> None:
    """Point every cached mixer at its static buffers (the decode step), or None (prefill)."""
    for i, mixer in enumerate(cached.mixers):
        if isinstance(mixer, (CachedKDA, CachedMLA)):
            mixer.static = None if buffers is None else buffers.layers[i]


class Decoder:
    """Prefill then decode a batch of prompts with static buffers (module docstring).

    Args:
        cached: the model with cached mixers (``CachedModel``), on its device.
        vocab: the tokenizer's size: the model's padded ids beyond it are never sampled.
        cuda_graph: replay the decode step from a CUDA graph (needs CUDA); False: eager.
        warmup: eager steps per batch size before its capture.
        graphs: the capture backend (tests pass a fake).
        compile_step: a ``torch.compile`` backend ("inductor") for the decode step's model call,
            or None. Why: a replayed k3_mini step at batch 1 is ~2,400 small kernels (copies,
            casts, elementwise ops between the GEMMs: benchmarks/bench_decode.py --profile), and
            fusing them shortens the replay. The step's shapes are fixed, so it compiles once
            per batch size (during the first warm-up step); prefill stays eager.
    """

    def __init__(self, cached: CachedModel, *, vocab: int | None = None, cuda_graph: bool = False,
                 warmup: int = 2, graphs: CudaGraphs | None = None, compile_step: str | None = None):
        self.cached, self.vocab = cached, vocab
        self.step_model = (cached.model if compile_step is None
                           else torch.compile(cached.model, backend=compile_step, dynamic=False))
        self.graphed = GraphedDecoder(enabled=cuda_graph, warmup=warmup, graphs=graphs)
        self.buffers: dict[int, DecodeBuffers] = {}

    def _last_logits(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, -1]
        return logits if self.vocab is None else logits[:, :self.vocab]

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], max_len: int) -> DecodeBuffers:
        """Run the prompts (a list of B token lists, any lengths >= 1) and return the batch's
        buffers holding their caches, positions and last logits; ``max_len``: the most tokens
        a sequence will hold (prompt and generated)."""
        B, device = len(prompts), next(self.cached.parameters()).device
        buf = self.buffers.get(B)
        if buf is not None and buf.max_len < max_len:
            buf = None
            self.graphed.forget()  # captured against the buffers being replaced
        rows_of: dict[int, list[int]] = {}
        for row, prompt in enumerate(prompts):
            rows_of.setdefault(len(prompt), []).append(row)
        bind(self.cached, None)
        for rows in rows_of.values():
            self.cached.reset()
            logits = self._last_logits(self.cached(torch.tensor([prompts[r] for r in rows], device=device)))
            if buf is None:
                buf = self.buffers[B] = DecodeBuffers.like(
                    self.cached, B, -(-max_len // LENGTH_STEP) * LENGTH_STEP, logits)
            buf.load(self.cached, rows, logits)
        self.cached.reset()
        bind(self.cached, buf)
        return buf

    def _step(self, buf: DecodeBuffers, temperature: float, top_p: float) -> None:
        """One token per sequence, every read and write in ``buf`` (capturable)."""
        buf.logits.copy_(self._last_logits(self.step_model(buf.token[:, None])))
        buf.pos.add_(1)
        self._sample(buf, temperature, top_p)

    @staticmethod
    def _sample(buf: DecodeBuffers, temperature: float, top_p: float) -> None:
        buf.token.copy_(sample_tokens(buf.logits, temperature, top_p, buf.seed, buf.counter))
        buf.counter.add_(1)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, keep_logits: list | None = None
                 ) -> tuple[list[list[int]], dict]:
        """``max_new_tokens`` tokens after each prompt -> (B lists of new ids, timings
        {prefill_s, decode_s, decode_tokens_per_s (all sequences together), cuda_graph}).
        ``keep_logits``: a list receiving each sampled token's logits ``[B, vocab]`` (tests)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = next(self.cached.parameters()).device
        self.cached.model.eval()
        t0 = time.perf_counter()
        buf = self.prefill(prompts, max(len(p) for p in prompts) + max_new_tokens)
        buf.seed.fill_(seed)
        buf.counter.zero_()
        self._sample(buf, temperature, top_p)
        _sync(device)
        t1 = time.perf_counter()
        out = [buf.token.clone()]
        if keep_logits is not None:
            keep_logits.append(buf.logits.clone())
        step = functools.partial(self._step, buf, temperature, top_p)
        key = (buf.batch, buf.max_len, temperature, top_p)
        for _ in range(max_new_tokens - 1):
            self.graphed.run(key, step)
            out.append(buf.token.clone())
            if keep_logits is not None:
                keep_logits.append(buf.logits.clone())
        ids = torch.stack(out, 1).tolist()  # the one host read
        t2 = time.perf_counter()
        steps = max(max_new_tokens - 1, 1) * len(prompts)
        return ids, {"prefill_s": t1 - t0, "decode_s": t2 - t1,
                     "decode_tokens_per_s": steps / max(t2 - t1, 1e-9), "cuda_graph": self.graphed.enabled}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
