"""prepare-data throughput on CPU: tokens/s and MB/s per tokenizer kind, 1 worker vs N workers.

Input: the Python standard library's train files (data.source=stdlib's documents), written once
as a .jsonl, capped at --mb megabytes. The tokenizers are made first (not timed): a byte-level
BPE trained on the same text (k3train train-tokenizer's code), that BPE as a tiktoken file, and
a sentencepiece BPE. Every configuration runs in this one process, one after another, on the
same input, so the ratios compare like with like; on a shared machine absolute numbers are noisy.

    python3 -m benchmarks.bench_prepare_data --json out.json [--mb 8] [--workers 2] [--vocab 8192]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


from k3train.data.prepare import prepare_data  # noqa: E402
from k3train.data.stdlib_corpus import stdlib_documents  # noqa: E402
from k3train.data.tokenizer import load_tokenizer  # noqa: E402
from benchmarks.tokenizer_files import train_sentencepiece, write_tiktoken  # noqa: E402
from k3train.data.train_tokenizer import train_bpe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="results file")
    ap.add_argument("--mb", type=float, default=8.0, help="input size cap in MB (stdlib train files in order)")
    ap.add_argument("--workers", type=int, default=2, help="the multi-process configuration's worker count")
    ap.add_argument("--vocab", type=int, default=8192, help="vocab size of the trained BPE and sentencepiece")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    docs, size = [], 0
    for _, text in stdlib_documents("train"):
        docs.append(text)
        size += len(text.encode("utf-8"))
        if size >= args.mb * 1e6:
            break
    inp = work / "stdlib.jsonl"
    inp.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    print(f"input: {len(docs)} stdlib files, {size / 1e6:.1f} MB; cores visible: {os.cpu_count()}", flush=True)

    t = time.perf_counter()
    hf = train_bpe(docs, args.vocab, work / "bpe")
    sp = train_sentencepiece(docs[:200], min(args.vocab, 8000), work / "sp.model")
    specs = {"byte": "byte", "hf": str(hf), "tiktoken": str(write_tiktoken(hf, work / "bpe.tiktoken")),
             "sentencepiece": str(sp)}
    print(f"tokenizers made in {time.perf_counter() - t:.1f} s (not timed below)", flush=True)

    # Warm-up (not timed): the first prepare_data imports megatron-core, seconds on its own.
    (work / "warm.txt").write_text("warm up")
    prepare_data([work / "warm.txt"], work / "warm", load_tokenizer("byte"), progress=False)
    rows = []
    for kind, spec in specs.items():
        tok = load_tokenizer(spec)
        for workers in (1, args.workers):
            t = time.perf_counter()
            stats = prepare_data([inp], work / f"{kind}_{workers}", tok, workers=workers, progress=False)
            dt = time.perf_counter() - t
            rows.append({"kind": kind, "vocab_size": tok.vocab_size, "workers": workers, "seconds": dt,
                         "tokens": stats["num_tokens"], "tokens_per_s": stats["num_tokens"] / dt,
                         "mb_per_s": size / 1e6 / dt, "bytes_per_token": size / stats["num_tokens"]})
            print(f"  {kind:13s} workers={workers}: {dt:6.2f} s", flush=True)
    by = {(r["kind"], r["workers"]): r for r in rows}
    print(f"\n{'tokenizer':13s} {'vocab':>6s} {'bytes/tok':>9s} {'tok/s (1)':>11s} "
          f"{'tok/s (' + str(args.workers) + ')':>11s} {'speedup':>8s}")
    for kind in specs:
        one, many = by[(kind, 1)], by[(kind, args.workers)]
        many["speedup_vs_1"] = many["tokens_per_s"] / one["tokens_per_s"]
        print(f"{kind:13s} {one['vocab_size']:6d} {one['bytes_per_token']:9.2f} {one['tokens_per_s']:11.3g} "
              f"{many['tokens_per_s']:11.3g} {many['speedup_vs_1']:7.2f}x")
    Path(args.json).write_text(json.dumps({"input_mb": size / 1e6, "documents": len(docs), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
