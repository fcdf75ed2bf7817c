"""``k3train generate``: sample a continuation of a prompt from a checkpoint, with the inference cache.

The prompt is prefilled in one forward (chunked KDA, full causal attention over the latent);
each new token then costs one cached step (``k3train.infer.cache``). Sampling: temperature
(0 = greedy), then nucleus (top-p) filtering, drawn from a generator seeded by ``seed``.
``check_sampling`` refuses settings that cannot sample (a non-finite or negative temperature, a
top-p outside (0, 1], a token count outside 1..``MAX_NEW_TOKENS``: the model has no positional
limit, so the cap is explicit).
"""
from __future__ import annotations

import math
import sys
import time

import torch

from k3train.errors import UsageError
from k3train.infer.cache import CachedModel
from k3train.ops import kernels, triton_compile
from k3train.runtime.device import resolve_device
from k3train.runtime.one_process import process_groups
from k3train.trainer.data import run_tokenizer
from k3train.trainer.restore import load_model

# The model has no context limit of its own (no positional encoding), so the number of new
# tokens is capped explicitly: a mistyped 1000000000 would otherwise decode for days.
MAX_NEW_TOKENS = 1_000_000


def check_sampling(temperature: float, top_p: float, max_new_tokens: int) -> None:
    """Raise UsageError (one line naming the flag) unless ``temperature`` is finite and >= 0
    (0 means greedy), ``0 < top_p <= 1`` and ``1 <= max_new_tokens <= MAX_NEW_TOKENS``."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise UsageError(f"--temperature {temperature}: expected a finite number > 0, or 0 for greedy decoding")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise UsageError(f"--top-p {top_p}: expected 0 < top-p <= 1")
    if not (isinstance(max_new_tokens, int) and 1 <= max_new_tokens <= MAX_NEW_TOKENS):
        raise UsageError(f"--max-new-tokens {max_new_tokens}: expected 1 to {MAX_NEW_TOKENS:,}")


def text_codec(cfg):
    """(encode: str -> list[int], decode: list[int] -> str, vocabulary size) of the run's
    tokenizer: the one place generation asks about the tokenizer."""
    tok = run_tokenizer(cfg)  # data.tokenizer, else what the dataset's meta file records, else byte
    return tok.encode, tok.decode, tok.vocab_size


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """logits [B, vocab] -> next token ids [B]."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate_ids(cached, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float,
                 seed: int, device, vocab: int | None = None) -> tuple[list[int], dict]:
    """Sample ``max_new_tokens`` after ``prompt`` with ``cached`` (a ``CachedModel``); returns
    (new ids, timings {prefill_s, decode_s, decode_tokens_per_s}). vocab: the tokenizer's size;
    the model's padded ids beyond it are never sampled. Refuses what ``check_sampling`` refuses."""
    check_sampling(temperature, top_p, max_new_tokens)
    gen = torch.Generator().manual_seed(seed)
    cached.reset()

    def last(logits):
        logits = logits[:, -1]
        return logits if vocab is None else logits[:, :vocab]

    t0 = time.perf_counter()
    logits = last(cached(torch.tensor([prompt], device=device)))
    t1 = time.perf_counter()
    out = []
    for i in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p, gen)
        out.append(int(nxt[0]))
        if i + 1 < max_new_tokens:
            logits = last(cached(nxt[:, None]))
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    steps = max(max_new_tokens - 1, 1)
    return out, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_tokens_per_s": steps / max(t2 - t1, 1e-9)}


def run_generate(args) -> int:
    """``k3train generate``: ``args.checkpoint`` (a run, checkpoints/ or step directory of any
    layout) opened in one process by ``k3train.trainer.restore.load_model``."""
    check_sampling(args.temperature, args.top_p, args.max_new_tokens)  # before the checkpoint is read
    with process_groups():
        device = resolve_device(args.device, setting="--device").type
        model, cfg, step_dir = load_model(args.checkpoint, args.config, args.overrides, device)
        kernels.apply(cfg)
        encode, decode, vocab = text_codec(cfg)
        prompt = encode(args.prompt)
        if not prompt:
            raise UsageError("--prompt is empty: give at least one character")
        cached = CachedModel(model)
        if kernels.uses_triton(device):
            # fla's kernels otherwise compile on first use, one after another (minutes on a
            # fresh GPU machine): compile the prefill's and a decode step's at once, in a
            # throwaway greedy pass (its outputs are garbage; generate_ids resets the cache).
            triton_compile.compile_ahead(lambda: generate_ids(cached, prompt[:16], 2, 0.0, 1.0, 0, device, vocab),
                                         label="generation")
        ids, timing = generate_ids(cached, prompt, args.max_new_tokens, args.temperature,
                                   args.top_p, args.seed, device, vocab)
    sys.stdout.write(args.prompt + decode(ids) + "\n")
    print(f"[k3train] {len(ids)} tokens from {step_dir} in {timing['prefill_s'] + timing['decode_s']:.2f} s "
          f"(decode {timing['decode_tokens_per_s']:.1f} tok/s, {device})", file=sys.stderr)
    return 0


__all__ = ["MAX_NEW_TOKENS", "check_sampling", "generate_ids", "load_model", "run_generate", "sample_next", "text_codec"]
