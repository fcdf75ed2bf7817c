"""``k3train generate``: sample continuations of prompts from a checkpoint, with the inference cache.

The prompts (``--prompt`` once and ``--batch N``: N samples of it; or several ``--prompt``, of any
lengths) are prefilled in chunked forwards (chunked KDA, full causal attention over the
latent); then every new token of every sequence costs one static-buffer decode step
(``k3train.infer.decoder``), replayed from a CUDA graph where ``--cuda-graph`` resolves to on
(``auto``: on for CUDA). Sampling: temperature (0 = greedy), then nucleus (top-p) filtering,
drawn on the device from noise keyed by ``--seed`` (``k3train.infer.sampling``).
"""
from __future__ import annotations

import math
import sys

import torch

from k3train.errors import UsageError
from k3train.infer.cache import CachedModel
from k3train.infer.decoder import Decoder
from k3train.ops import kernels, triton_compile
from k3train.runtime.device import resolve_device
from k3train.runtime.one_process import process_groups
from k3train.runtime.threads import apply_threads
from k3train.trainer.data import run_tokenizer
from k3train.trainer.restore import load_model


# The most tokens one generate call samples: a typo of a few zeros must not run for hours.
MAX_NEW_TOKENS = 100_000
# The most sequences one call decodes together (the static buffers are allocated for all).
MAX_BATCH = 1024


def text_codec(cfg):
    """(encode: str -> list[int], decode: list[int] -> str, vocabulary size) of the run's
    tokenizer: the one place generation asks about the tokenizer."""
    tok = run_tokenizer(cfg)  # data.tokenizer, else what the dataset's meta file records, else byte
    return tok.encode, tok.decode, tok.vocab_size


def resolve_cuda_graph(setting: str, device: str) -> tuple[bool, str]:
    """``--cuda-graph auto|true|false`` on ``device`` -> (on, why), the reason for the banner."""
    if setting not in ("auto", "true", "false"):
        raise UsageError(f"--cuda-graph {setting}: expected auto, true or false")
    if setting == "false":
        return False, "off (--cuda-graph false)"
    if device != "cuda":
        if setting == "true":
            raise UsageError(f"--cuda-graph true needs a CUDA device, and this run decodes on {device}; "
                             "use --cuda-graph auto or false")
        return False, f"off (auto: {device} has no CUDA graphs)"
    return True, "on (" + ("auto: " if setting == "auto" else "") + "captured once per batch size, replayed)"


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_dtype(setting: str, device: str) -> torch.dtype:
    """``--dtype auto|bf16|fp32`` on ``device``: auto is bf16 on CUDA (the precision training's
    autocast multiplies in; the decode step reads half the bytes) and fp32 elsewhere."""
    if setting == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    if setting not in DTYPES:
        raise UsageError(f"--dtype {setting}: expected auto, bf16 or fp32")
    return DTYPES[setting]


def batch_prompts(prompts: list[str], batch: int | None) -> list[str]:
    """The prompt of each sequence: ``--prompt`` given once and ``--batch N``: that prompt N
    times (N independent samples); several ``--prompt``: one sequence each (``--batch``, if
    given, must equal their count)."""
    if batch is None:
        return list(prompts)
    if not 1 <= batch <= MAX_BATCH:
        raise UsageError(f"--batch {batch}: expected 1 to {MAX_BATCH:,} sequences")
    if len(prompts) == 1:
        return prompts * batch
    if batch != len(prompts):
        raise UsageError(f"--batch {batch} with {len(prompts)} --prompt values: give one --prompt "
                         f"(repeated {batch} times) or {batch} of them, or leave --batch out")
    return list(prompts)


def run_generate(args) -> int:
    """``k3train generate``: ``args.checkpoint`` (a run, checkpoints/ or step directory of any
    layout) opened in one process by ``k3train.trainer.restore.load_model``."""
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: expected 1 to {MAX_NEW_TOKENS:,}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature {args.temperature}: expected a finite number >= 0 (0: greedy)")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise UsageError(f"--top-p {args.top_p}: expected 0 < top-p <= 1")

    texts = batch_prompts(args.prompt, args.batch)
    if any(not t for t in texts):
        raise UsageError("--prompt is empty: give at least one character")

    with process_groups():
        device = resolve_device(args.device, setting="--device").type
        graphed, why = resolve_cuda_graph(args.cuda_graph, device)
        dtype = resolve_dtype(getattr(args, "dtype", "auto"), device)
        model, cfg, step_dir = load_model(args.checkpoint, args.config, args.overrides, device)
        model = model.to(dtype)   # the checkpoint's fp32 master weights, cast for decoding
        apply_threads(cfg.train.threads)
        kernels.apply(cfg)
        encode, decode, vocab = text_codec(cfg)
        prompts = [encode(t) for t in texts]
        if any(not p for p in prompts):
            raise UsageError("--prompt encodes to no tokens: give at least one character")
        cached = CachedModel(model)
        print(f"[k3train] decoding {len(prompts)} sequence{'s' if len(prompts) > 1 else ''} on {device}; "
              f"in {str(dtype).removeprefix('torch.')}; CUDA graph {why}", file=sys.stderr, flush=True)
        if kernels.uses_triton(device):
            # fla's kernels otherwise compile on first use, one after another (minutes on a
            # fresh GPU machine): compile the prefill's and a decode step's at once, in a
            # throwaway greedy pass (its outputs are garbage), eager and with buffers of its own.
            warm = Decoder(cached, vocab=vocab, cuda_graph=False)
            triton_compile.compile_ahead(lambda: warm.generate([p[:16] for p in prompts], 2),
                                         label="generation")
        decoder = Decoder(cached, vocab=vocab, cuda_graph=graphed,
                          compile_step="inductor" if getattr(args, "compile", False) else None)
        ids, timing = decoder.generate(prompts, args.max_new_tokens, args.temperature, args.top_p, args.seed)
    for i, (text, new) in enumerate(zip(texts, ids)):
        if len(ids) > 1:
            sys.stdout.write(f"=== sample {i} ===\n")
        sys.stdout.write(text + decode(new) + "\n")
    total = sum(len(new) for new in ids)
    print(f"[k3train] {total} tokens from {step_dir} in {timing['prefill_s'] + timing['decode_s']:.2f} s "
          f"(decode {timing['decode_tokens_per_s']:.1f} tok/s over {len(ids)} sequence{'s' if len(ids) > 1 else ''}, "
          f"{device}, CUDA graph {'on' if timing['cuda_graph'] else 'off'})", file=sys.stderr)
    return 0


__all__ = ["batch_prompts", "load_model", "resolve_cuda_graph", "resolve_dtype", "run_generate", "text_codec"]
