"""Single-GPU training step: tokens/s and MFU of k3_mini, and our step against fla's KDA model.

    python3 -m benchmarks.bench_step [--json OUT] [--mbs 8 --seq 2048 --steps 8]
    python3 -m benchmarks.bench_step --device cpu --small        # CPU dry run of our side only

Rows, all measured in this one run:
* ``k3_mini``: the config as shipped (hybrid KDA/MLA, Stable LatentMoE, AttnRes, Muon), stepped by
  ``TrainState.train_step``, exactly what ``k3train train`` runs. MFU = tokens/s x
  ``k3train.model.flops.flops_per_token`` / peak, where the peak is a bf16 8192^3 matmul timed in this
  run (not the datasheet), so MFU is relative to what this GPU really sustains.
* ``k3_mini_accum4`` (row ``k3_mini_accum``): the same with 4 microbatches accumulated per
  update, a 4x global batch; the optimizer update, a fixed cost per step (Muon's Newton-Schulz
  on every expert), is then amortised as in a real run. Every row also reports ``optimizer_ms``,
  the update alone.
* ``k3_mini_unmasked`` / ``k3_mini_docmask_<doc_len>`` (row ``docmask``, ``--doc-len``): k3_mini
  eager on the same windows holding a document every ``doc_len`` tokens, without and with
  document masking (``data.document_mask``, docs/data.md): the cost of masking.
* The dense peer comparison at k3_mini's width and depth: every layer KDA + a dense SwiGLU-class
  FFN (fla's model has no MoE, and its softmax-attention layers need flash-attn), AttnRes off and
  on, AdamW on both sides, fp32 master weights with bf16 autocast on both sides. The peer is
  ``fla.models.KDAForCausalLM`` (safe gate, lower bound -5, fused norm/SwiGLU/cross-entropy; its
  ``attnres_block_size`` counts sublayers, so it is twice our layers-per-block). Reported: each
  step time and fla/ours (> 1 means we are faster).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch

from benchmarks.common import matmul_tflops, op_table, profile_table, save_json, timeit  # noqa: E402

warnings.filterwarnings("ignore")

SMALL = ["model.hidden_size=64", "model.num_layers=4", "model.kda.num_heads=2", "model.kda.head_dim=32",
         "model.mla.num_heads=2", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8",
         "model.mla.v_head_dim=16", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
         "model.ffn.intermediate_size=128", "moe.num_experts=8", "moe.topk=2", "moe.latent_size=32",
         "moe.expert_ffn_size=32", "moe.shared_ffn_size=64"]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step, batches, warmup: int, device: str) -> list[float]:
    """Wall seconds of each step after ``warmup`` (the first steps compile and autotune)."""
    times = []
    for i, batch in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        step(batch)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def optimizer_ms(state, batch, device: str, iters: int = 3) -> float:
    """Median time of the optimizer update alone (after one forward/backward fills the grads)."""
    state._forward_backward(batch)
    ms = timeit(state.optimizer.step, warmup=1, iters=iters, device=device)
    state.optimizer.zero_grad(set_to_none=True)
    for layer in state.moe_layers:
        layer.routing.clear()
    return ms


def ours(config: str, overrides: list[str], args, peak_tflops: float, microbatches: int = 1,
         doc_len: int | None = None) -> dict:
    """Step time, tokens/s and MFU of our trainer on ``config`` + ``overrides``, each step
    ``microbatches`` forward/backward passes of ``mbs x seq`` tokens and one optimizer update.
    doc_len: an end-of-document token every ``doc_len`` tokens of every window, masked unless
    the overrides say ``data.document_mask=false`` (None: random windows, one sequence each, and
    document masking off, so CUDA graphs stay as ``train.cuda_graph`` says)."""
    from k3train.config import load_config
    from k3train.data.documents import WindowDocuments
    from k3train.runtime.distributed import init_distributed
    from k3train.model.flops import mfu
    from k3train.trainer.state import TrainState

    cpu = ["train.cuda_graph=false"] if args.device == "cpu" else []  # graphs are CUDA-only
    unmasked = [] if doc_len else ["data.document_mask=false"]
    cfg = load_config(config, [*unmasked, *overrides, *cpu, f"train.device={args.device}", f"train.micro_batch_size={args.mbs}",
                               f"train.seq_len={args.seq}", f"train.microbatches={microbatches}",
                               "logging.wandb.mode=disabled"])
    info = init_distributed(device=args.device)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    eod = 0   # any id: the boundaries are read from where it stands
    documents = WindowDocuments(eod) if doc_len and cfg.data.masks_documents else None
    state = TrainState(cfg, info, dev, documents=documents)
    compiled = state.compile_kernels()  # all Triton kernels + autotune candidates, in parallel
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1 if doc_len else 0, cfg.model.vocab_size, (args.mbs * microbatches, args.seq + 1),
                             generator=g)
               for _ in range(args.steps + args.warmup)]
    for b in batches:
        if doc_len:
            b[:, doc_len::doc_len] = eod
    losses = []
    times = time_steps(lambda b: losses.append(state.train_step(b)["loss"]), batches, args.warmup, args.device)
    step_s = statistics.median(times)
    tok_s = args.mbs * microbatches * args.seq / step_s
    row = {"step_ms": step_s * 1e3, "tokens_per_s": tok_s, "first_loss": losses[0], "last_loss": losses[-1],
           "microbatches": microbatches, "optimizer_ms": optimizer_ms(state, batches[0], args.device),
           "params": sum(p.numel() for p in state.params), "compile_ahead": compiled}
    if peak_tflops > 0:
        row["mfu"] = mfu(tok_s, cfg, peak_tflops * 1e12, seq_len=args.seq)
    if args.device == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    if args.profile:
        print(f"profile of {config} {' '.join(overrides)}:\n"
              + profile_table(lambda: state.train_step(batches[0]), device=args.device), flush=True)
        if args.profile_shapes:
            print("the same, split by input shapes:\n" + profile_table(
                lambda: state.train_step(batches[0]), rows=40, device=args.device, shapes=True), flush=True)
        if args.profile_ops and args.device == "cuda":
            print("aten operators by the device time of their kernels (eager steps only):\n"
                  + op_table(lambda: state.train_step(batches[0]), rows=60), flush=True)
    del state
    return row


def fla_peer(cfg_overrides: dict, args, attnres_layers: int | None, graph: bool = False) -> dict:
    """fla's KDAForCausalLM stepped like ours: bf16 autocast over fp32 weights, clip 1.0, fused AdamW.
    graph: its forward/backward replayed from a CUDA graph by the same wrapper as ours
    (``k3train.trainer.cuda_graph``), so that both sides drop the host's launch cost."""
    from fla.models import KDAConfig, KDAForCausalLM

    from k3train.ops.triton_compile import compile_ahead
    from k3train.trainer.cuda_graph import GraphedForwardBackward

    c = cfg_overrides
    conf = KDAConfig(hidden_size=c["hidden"], num_heads=c["heads"], head_dim=c["head_dim"],
                     num_hidden_layers=c["layers"], intermediate_size=c["ffn"], vocab_size=c["vocab"],
                     safe_gate=True, lower_bound=-5.0, conv_size=4, use_cache=False,
                     attnres_block_size=None if attnres_layers is None else 2 * attnres_layers)
    torch.manual_seed(0)
    model = KDAForCausalLM(conf).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, c["vocab"], (args.mbs, args.seq), generator=g)
               for _ in range(args.steps + args.warmup)]
    losses = []

    def fwd_bwd(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not graph):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.detach()

    # Every Triton kernel and autotune candidate compiled in parallel (a throwaway pass).
    compiled = compile_ahead(lambda: fwd_bwd(batches[0].cuda()), label="fla KDAForCausalLM")
    opt.zero_grad(set_to_none=True)

    run = GraphedForwardBackward(fwd_bwd, list(model.parameters()), []) if graph else fwd_bwd

    def step(batch):
        loss = run(batch.cuda(non_blocking=True))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the same one host sync per step as our trainer

    times = time_steps(step, batches, args.warmup, "cuda")
    step_s = statistics.median(times)
    row = {"step_ms": step_s * 1e3, "tokens_per_s": args.mbs * args.seq / step_s,
           "first_loss": losses[0], "last_loss": losses[-1], "params": sum(p.numel() for p in model.parameters()),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "compile_ahead": compiled}
    torch.cuda.reset_peak_memory_stats()
    del model, opt
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/k3_mini.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny widths (CPU dry run)")
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="skip the fla comparison")
    ap.add_argument("--rows", default="k3_mini,dense,peer",
                    help="comma list of k3_mini, k3_mini_eager, k3_mini_accum, fp8, mxfp8, mxfp4_qat (each graphed "
                         "and eager), dense, peer, docmask")
    ap.add_argument("--doc-len", type=int, default=0,
                    help="the docmask rows' document length (default seq/4): k3_mini eager with "
                         "documents unmasked and masked (data.document_mask), side by side")
    ap.add_argument("--profile", action="store_true", help="print the top operators of our rows")
    ap.add_argument("--profile-ops", action="store_true",
                    help="with --profile, also list aten operators and their shapes by device time "
                         "(use on an eager row: a replayed graph shows kernels only)")
    ap.add_argument("--profile-shapes", action="store_true",
                    help="with --profile, also split the operators by input shape")
    ap.add_argument("--json")
    args = ap.parse_args()
    from k3train.config import load_config

    base = SMALL if args.small else []
    rows_wanted = set(args.rows.split(","))
    peak = matmul_tflops() if args.device == "cuda" else 0.0
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "bf16_matmul_tflops": peak, "mbs": args.mbs, "seq": args.seq, "rows": {}}
    rows = result["rows"]

    def report(name: str, row: dict) -> None:
        rows[name] = row
        print(json.dumps({name: row}), flush=True)

    if "k3_mini" in rows_wanted:
        report("k3_mini", ours(args.config, base, args, peak))
    if "k3_mini_eager" in rows_wanted:
        report("k3_mini_eager", ours(args.config, [*base, "train.cuda_graph=false"], args, peak))
    for recipe in ("fp8", "mxfp8", "mxfp4_qat"):
        # Each precision recipe graphed and eager, side by side (train.cuda_graph under the
        # quantisation recipes; the target is graphed >= 1.5x eager for fp8).
        if recipe in rows_wanted:
            report(f"k3_mini_{recipe}", ours(args.config, [*base, f"precision.recipe={recipe}"], args, peak))
            report(f"k3_mini_{recipe}_eager", ours(args.config, [*base, f"precision.recipe={recipe}",
                                                                 "train.cuda_graph=false"], args, peak))
            a, b = rows[f"k3_mini_{recipe}"], rows[f"k3_mini_{recipe}_eager"]
            result[f"{recipe}_graph_over_eager"] = a["tokens_per_s"] / b["tokens_per_s"]
    if "k3_mini_accum" in rows_wanted:
        # The same model with a 4x global batch (4 microbatches accumulated per update): the
        # optimizer step, fixed per update, is amortised as in a real run's large batch.
        report("k3_mini_accum4", ours(args.config, base, args, peak, microbatches=4))
    if "docmask" in rows_wanted:
        # Eager both: CUDA graphs are off under document masking. The same token batches; only
        # the masking differs (the unmasked row gets no boundaries at all).
        doc_len = args.doc_len or max(1, args.seq // 4)
        eager = [*base, "train.cuda_graph=false"]
        report("k3_mini_unmasked", ours(args.config, [*eager, "data.document_mask=false"], args, peak,
                                        doc_len=doc_len))
        report(f"k3_mini_docmask_{doc_len}", ours(args.config, eager, args, peak, doc_len=doc_len))
    cfg = load_config(args.config, base)
    m = cfg.model
    dense = [*base, "model.layer_pattern=K", f"model.dense_layers={m.num_layers}", "optim.name=adamw"]
    if "dense" in rows_wanted:
        report("ours_dense", ours(args.config, [*dense, "model.attnres.enabled=false"], args, peak))
        report("ours_dense_attnres", ours(args.config, [*dense, "model.attnres.enabled=true"], args, peak))
    if "peer" in rows_wanted and not args.no_peer and args.device == "cuda":
        shape = {"hidden": m.hidden_size, "heads": m.kda.num_heads, "head_dim": m.kda.head_dim,
                 "layers": m.num_layers, "ffn": m.ffn.intermediate_size, "vocab": m.vocab_size}
        peers = [("fla_dense", None, False), ("fla_dense_attnres", m.attnres.block_size, False),
                 ("fla_dense_graph", None, True)]
        for name, block, graph in peers:
            try:
                report(name, fla_peer(shape, args, block, graph))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, ours still stand
                report(name, {"error": repr(exc)[:400]})
        for ours_row, peer_row, key in (("ours_dense", "fla_dense", "fla_over_ours"),
                                        ("ours_dense_attnres", "fla_dense_attnres", "fla_over_ours_attnres"),
                                        ("ours_dense", "fla_dense_graph", "fla_graph_over_ours")):
            a, b = rows.get(ours_row, {}), rows.get(peer_row, {})
            if "step_ms" in a and "step_ms" in b:
                result[key] = b["step_ms"] / a["step_ms"]
    print(f"\n{'row':<22}{'params':>9}{'step ms':>10}{'tok/s':>12}{'MFU':>8}{'loss':>14}")
    for name, r in rows.items():
        if "step_ms" in r:
            mfu_txt = f"{r['mfu']:.1%}" if "mfu" in r else "-"
            print(f"{name:<22}{r['params'] / 1e6:>8.1f}M{r['step_ms']:>10.1f}{r['tokens_per_s']:>12.0f}{mfu_txt:>8}"
                  f"{r['first_loss']:>7.2f}{r['last_loss']:>7.2f}")
        else:
            print(f"{name:<22} failed: {r.get('error')}")
    for recipe in ("fp8", "mxfp8", "mxfp4_qat"):
        if f"{recipe}_graph_over_eager" in result:
            print(f"{recipe}: graphed / eager tokens/s {result[f'{recipe}_graph_over_eager']:.2f}x")
    for key in ("fla_over_ours", "fla_over_ours_attnres", "fla_graph_over_ours"):
        if key in result:
            print(f"{key}: {result[key]:.2f}x (fla step time / ours; > 1 means ours is faster)")
    save_json(args.json, result)


if __name__ == "__main__":
    main()
