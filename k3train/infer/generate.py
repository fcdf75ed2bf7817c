"""``k3train generate``: sample a continuation of a prompt from a checkpoint, with the inference cache.

The prompt is prefilled in one forward (chunked KDA, full causal attention over the latent);
each new token then costs one cached step (``k3train.infer.cache``). Sampling: temperature
(0 = greedy), then nucleus (top-p) filtering, drawn from a generator seeded by ``seed``.
"""
from __future__ import annotations

import sys
import time

import torch

from k3train.errors import UsageError


def text_codec(cfg):
    """(encode: str -> list[int], decode: list[int] -> str, vocabulary size) of the run's
    tokenizer: the one place generation asks about the tokenizer."""
    from k3train.trainer.data import run_tokenizer

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


def load_model(checkpoint, config: str | None, overrides: list[str], device: str):
    """(one-process model with the checkpoint's weights, run config). Any layout's checkpoint."""
    from k3train.config.schema import ParallelConfig
    from k3train.trainer.evaluate import eval_config
    from k3train.model.model import build_model
    from k3train.quant.export import resolve_checkpoint
    from k3train.trainer.checkpoint import verify_checkpoint
    from k3train.trainer.state_io import load_weights

    step_dir = resolve_checkpoint(checkpoint)
    cfg = eval_config(step_dir, config, list(overrides), None)
    # One process holds the whole model; the dispatcher is the local one. The compiled pieces
    # are shape-specialised (fullgraph, dynamic=False): a sequence that grows by one token per
    # call would compile once per length and stop at Dynamo's recompile limit (seen on an H200).
    cfg = cfg.model_copy(update={"parallel": ParallelConfig(),
                                 "kernels": cfg.kernels.model_copy(update={"compile": False}),
                                 "moe": cfg.moe.model_copy(update={"dispatcher": "local"}),
                                 "train": cfg.train.model_copy(update={"device": device})})
    manifest = verify_checkpoint(step_dir, 1, None)
    if "tensors" not in manifest:
        raise UsageError(f"{step_dir} is a checkpoint of the older per-rank format; resume it once to convert it")
    model = build_model(cfg).to(device)
    load_weights(model, step_dir, manifest, 1, 0)
    return model, cfg, step_dir


@torch.no_grad()
def generate_ids(cached, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float,
                 seed: int, device, vocab: int | None = None) -> tuple[list[int], dict]:
    """Sample ``max_new_tokens`` after ``prompt`` with ``cached`` (a ``CachedModel``); returns
    (new ids, timings {prefill_s, decode_s, decode_tokens_per_s}). vocab: the tokenizer's size;
    the model's padded ids beyond it are never sampled."""
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
    from k3train.runtime.distributed import init_distributed, shutdown_distributed
    from k3train.infer.cache import CachedModel
    from k3train.ops import kernels
    from k3train.ops import triton_compile
    from k3train.trainer.loop import pick_device

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: expected at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError(f"--temperature {args.temperature} --top-p {args.top_p}: need temperature >= 0 "
                         f"and 0 < top-p <= 1")
    init_distributed()
    try:
        device = pick_device(args.device)
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
    finally:
        shutdown_distributed()
    sys.stdout.write(args.prompt + decode(ids) + "\n")
    print(f"[k3train] {len(ids)} tokens from {step_dir} in {timing['prefill_s'] + timing['decode_s']:.2f} s "
          f"(decode {timing['decode_tokens_per_s']:.1f} tok/s, {device})", file=sys.stderr)
    return 0


__all__ = ["generate_ids", "load_model", "run_generate", "sample_next", "text_codec"]
