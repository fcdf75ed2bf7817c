"""The capacity benchmark's child processes (``benchmarks/bench_capacity.py --worker KIND``): one
recompute mode's lengths, the per-layer-type time split, the offload check and the masking rows,
each writing JSON lines as it measures so that a killed child keeps what it measured."""
from __future__ import annotations

import gc
import json
import statistics
import time
import warnings
from types import SimpleNamespace

import torch

from benchmarks.bench_step import SMALL, ours
from benchmarks.capacity_search import doubling_lengths, search_lengths
from benchmarks.common import timeit
from k3train.config import load_config
from k3train.config.layer_pattern import expand_layer_pattern
from k3train.config.layout_rules import PER_DOCUMENT_MIN_WINDOW
from k3train.model.model import K3Chunk, build_model
from k3train.model.offload import ActivationOffload
from k3train.runtime.distributed import init_distributed
from k3train.trainer.state import TrainState, autocast_for

warnings.filterwarnings("ignore")

GiB = 2 ** 30

# --------------------------------------------------------------------------------------------
# Children: one recompute mode's lengths, the layer split, the masking rows
# --------------------------------------------------------------------------------------------

def mode_overrides(mode: str) -> list[str]:
    base, _, extra = mode.partition("+")
    if base not in ("none", "selective", "full") or extra not in ("", "offload"):
        raise ValueError(f"a mode is none, selective or full, optionally +offload; got {mode!r}")
    return [f"train.recompute={base}", f"train.offload_activations={'true' if extra else 'false'}"]


def base_overrides(args, seq: int) -> list[str]:
    small = [*SMALL] if args.small else []
    return [*small, f"train.device={args.device}", "train.micro_batch_size=1", "train.microbatches=1",
            f"train.seq_len={seq}", "logging.wandb.mode=disabled", *args.override]


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reset_step_state(state) -> None:
    """After a step that ran out of memory: no gradient, no routing record is left behind."""
    state.optimizer.zero_grad(set_to_none=True)
    for layer in state.moe_layers:
        layer.routing.clear()
    offload = getattr(state.model, "offload", None)
    if offload is not None:
        offload.reset_stats()


def _is_oom(exc: BaseException) -> bool:
    """Out of device memory, or out of pinned host memory (offload), or a library's workspace
    allocation failing under memory pressure (cuBLAS, cuDNN): all mean "this length does not fit"."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return any(k in text for k in ("out of memory", "ALLOC_FAILED", "cudaErrorMemoryAllocation"))


def _measure(state, T: int, args) -> dict:
    """``--warmup`` untimed and up to ``--steps`` timed steps at length T (one sequence); a step
    over ``--long-step-s`` is timed once."""
    dev = args.device
    _free(dev)
    g = torch.Generator().manual_seed(T)
    batch = torch.randint(0, state.cfg.model.vocab_size, (1, T + 1), generator=g)
    offload = getattr(state.model, "offload", None)
    t_start = time.monotonic()
    times, losses, oom = [], [], None
    try:
        if args.fake_oom_tokens and T > args.fake_oom_tokens:
            raise torch.OutOfMemoryError(f"fake: {T} > --fake-oom-tokens {args.fake_oom_tokens}")
        for i in range(args.warmup + args.steps):
            if offload is not None:
                offload.reset_stats()
            _sync(dev)
            t0 = time.perf_counter()
            out = state.train_step(batch)
            _sync(dev)
            dt = time.perf_counter() - t0
            losses.append(out["loss"])
            if i >= args.warmup:
                times.append(dt)
                if dt > args.long_step_s:
                    break
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not _is_oom(exc):
            raise   # anything else (a broken kernel) ends this child; the parent keeps its rows
        oom = str(exc).splitlines()[0][:240]
    row = {"status": "oom" if oom else "ok", "try_s": time.monotonic() - t_start}
    if dev == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        row["reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    if oom:
        row["error"] = oom
        _reset_step_state(state)
    else:
        step = statistics.median(times)
        row.update(step_s=step, tokens_per_s=T / step, timed_steps=len(times), losses=losses)
        if offload is not None:
            row["host_offloaded_gib"] = offload.stats.offloaded_bytes / GiB
    del batch
    _free(dev)
    return row


def _switch_mode(state, mode: str) -> None:
    """Run ``state``'s model under recompute ``mode`` from now on: the model reads
    ``train.recompute`` and ``train.offload_activations`` only in its forward (``K3Chunk``), so
    this is the model the mode's config builds, with the same weights, without building it again
    (the K3 slice takes minutes to build)."""
    base, _, extra = mode.partition("+")
    for module in state.model.modules():
        if isinstance(module, K3Chunk):
            module.recompute = base
            module.offload = ActivationOffload() if extra == "offload" else None


def worker_mode(args) -> None:
    """The lengths of each recompute mode of ``--worker`` (a comma list) in this one process, the
    model built once; a JSON line per row (with its ``mode``) into ``--worker-out``. Each mode gets
    an equal share of the time left when it starts."""
    modes = args.worker.split(",")
    lengths = doubling_lengths(args.min_seq, args.max_seq)
    cfg = load_config(args.config, [*base_overrides(args, lengths[0]), *mode_overrides(modes[0]),
                                    "train.cuda_graph=false", "data.document_mask=false"])
    out = open(args.worker_out, "a")

    def report(row, mode=None):
        out.write(json.dumps(row if mode is None else dict(row, mode=mode)) + "\n")
        out.flush()

    t0 = time.monotonic()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device=args.device), dev)
    state.schedule_lr(1)   # the warm-up rate of step 1, as a run starts (not the full rate)
    state.compile_kernels()
    report({"setup_s": time.monotonic() - t0, "params": sum(p.numel() for p in state.params),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "static_gib": (torch.cuda.memory_allocated() / GiB) if args.device == "cuda" else None})
    end = time.monotonic() + (args.deadline - time.time())
    for i, mode in enumerate(modes):
        _switch_mode(state, mode)
        deadline = time.monotonic() + (end - time.monotonic()) / (len(modes) - i)
        search_lengths(lambda T: _measure(state, T, args), lengths, deadline=deadline, refine=args.refine,
                       granule=args.min_seq, report=lambda row, m=mode: report(row, m))


def _layer_fns(model, cfg, device):
    """(name, index, fn(x) -> output) for one KDA mixer, one MLA mixer and one MoE FFN."""
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    out = []
    for kind, name in (("K", "kda"), ("M", "mla")):
        if kind in kinds:
            i = kinds.index(kind)
            layer = model.layers[i]
            out.append((name, i, lambda x, layer=layer: layer.mixer(layer.mixer_norm(x))))
    moe = [i for i in range(cfg.model.num_layers) if i >= cfg.model.dense_layers]
    if moe:
        layer = model.layers[moe[0]]
        out.append(("moe", moe[0], lambda x, layer=layer: layer._ffn(x)))
    return out


def worker_split(args) -> None:
    """Isolated fwd+bwd of one layer of each type at each length; JSON lines."""
    lengths = [int(t) for t in args.lengths.split(",")]
    cfg = load_config(args.config, [*base_overrides(args, lengths[0]), "train.recompute=none",
                                    "train.cuda_graph=false", "data.document_mask=false"])
    init_distributed(device=args.device)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(cfg).to(dev)
    model.train()
    autocast = autocast_for(cfg, dev)
    out = open(args.worker_out, "a")
    kinds = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    counts = {"kda": kinds.count("K"), "mla": kinds.count("M"),
              "moe": sum(1 for i in range(cfg.model.num_layers) if i >= cfg.model.dense_layers)}
    out.write(json.dumps({"counts": counts}) + "\n")
    out.flush()
    dtype = torch.bfloat16 if args.device == "cuda" and cfg.precision.recipe != "fp32" else torch.float32
    fns = _layer_fns(model, cfg, dev)
    deadline = time.monotonic() + (args.deadline - time.time())

    def try_length(T: int) -> dict:
        t_start = time.monotonic()
        row = {"status": "ok", "ms": {}}
        for name, index, fn in fns:
            x = torch.randn(1, T, cfg.model.hidden_size, device=dev, dtype=dtype, requires_grad=True)

            def run():
                with autocast:
                    y = fn(x)
                y.backward(torch.ones_like(y))
                x.grad = None
                for p in model.parameters():
                    p.grad = None
                for layer in model.moe_layers():
                    layer.routing.clear()
            try:
                # One warm-up (autotune at this shape), then the median of up to 3 timed calls.
                row["ms"][name] = timeit(run, warmup=1, iters=1 if T >= 262144 else 3, device=args.device)
            except torch.OutOfMemoryError:
                row["ms"][name] = None
            del x
            _free(args.device)
        row["try_s"] = time.monotonic() - t_start
        return row

    search_lengths(try_length, lengths, deadline=deadline,
                   report=lambda row: (out.write(json.dumps(row) + "\n"), out.flush()))


def worker_check(args) -> None:
    """Offload against no offload on the device: the forward/backward of one sequence of
    ``--check-seq`` tokens under ``full``, twice (the control: is the GPU step itself
    deterministic?), then under ``full+offload``, same weights and batch; the loss and every
    gradient compared. PASS: the loss is bitwise equal, offload's largest gradient difference is
    within twice the control's (the backward's atomics make the control non-zero on CUDA; the
    first version asked for <= the control, which two draws of the same noise fail half the
    time: 1.15e-3 against 1.10e-3 on the H200, 2026-12-04) and the hooks moved bytes to the host.
    Each pass's gradients are kept on the host, so the peaks compare the passes alone (the
    first version kept them on the device: the offload pass's peak carried two copies of the
    gradients, 10.9 -> 18.1 GiB at 16K on k3_mini)."""
    out = open(args.worker_out, "a")
    T = args.check_seq
    cfg = load_config(args.config, [*base_overrides(args, T), *mode_overrides("full"),
                                    "train.cuda_graph=false", "data.document_mask=false"])
    dev = torch.device(args.device)
    torch.manual_seed(0)
    state = TrainState(cfg, init_distributed(device=args.device), dev)
    batch = torch.randint(0, cfg.model.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(1))

    def grads(mode: str):
        _switch_mode(state, mode)
        _free(args.device)
        loss = state._forward_backward(batch)
        _sync(args.device)
        g = [p.grad.detach().cpu() if p.grad is not None else None for p in state.params]
        offload = getattr(state.model, "offload", None)
        moved = offload.stats.offloaded_bytes if offload is not None else 0
        state.optimizer.zero_grad(set_to_none=True)
        for layer in state.moe_layers:
            layer.routing.clear()
        peak = torch.cuda.max_memory_allocated() / GiB if args.device == "cuda" else None
        return loss.detach().cpu(), g, moved, peak

    def diff(a, b) -> float:
        (la, ga, _, _), (lb, gb, _, _) = a, b
        d = (la.float() - lb.float()).abs().item()
        for x, y in zip(ga, gb):
            if (x is None) != (y is None):
                return float("inf")
            if x is not None:
                d = max(d, (x.float() - y.float()).abs().max().item())
        return d

    ref = grads("full")
    again = grads("full")
    off = grads("full+offload")
    control, offload_diff = diff(ref, again), diff(ref, off)
    row = {"seq_len": T, "loss_full": ref[0].item(), "loss_offload": off[0].item(),
           "control_max_diff": control, "offload_max_diff": offload_diff,
           "offloaded_gib": off[2] / GiB, "peak_gib_full": ref[3], "peak_gib_offload": off[3],
           "pass": bool(torch.equal(ref[0], off[0])) and offload_diff <= 2 * control and off[2] > 0}
    out.write(json.dumps(row) + "\n")
    out.flush()


def worker_mask(args) -> None:
    """Masked and unmasked windows at each of --mask-seqs; JSON lines."""
    out = open(args.worker_out, "a")
    deadline = args.deadline
    small = [*SMALL] if args.small else []
    for seq in [int(s) for s in args.mask_seqs.split(",") if s]:
        doc_len = args.doc_len or max(1, seq // 4)
        # Three warm-up steps: a graphed row captures after two eager steps (from step 3).
        ns = SimpleNamespace(device=args.device, mbs=1, seq=seq, steps=args.mask_steps, warmup=3,
                             profile=False, profile_shapes=False, profile_ops=False)
        base = [*small, "train.recompute=none", *args.override]
        rows = [("unmasked_eager", [*base, "train.cuda_graph=false", "data.document_mask=false"]),
                ("masked_eager", [*base, "train.cuda_graph=false", "data.document_mask=true"]),
                ("unmasked_graphed", [*base, "train.cuda_graph=false" if args.device == "cpu" else "train.cuda_graph=auto",
                                      "data.document_mask=false"]),
                # graphed where the trainer can graph masked windows (below 16K tokens)
                ("masked_graphed", [*base, "train.cuda_graph=false" if args.device == "cpu" else
                                    "train.cuda_graph=true" if seq < PER_DOCUMENT_MIN_WINDOW else "train.cuda_graph=auto",
                                    "data.document_mask=true"])]
        wanted = set(args.mask_rows.split(",")) if args.mask_rows else None
        rows = [r for r in rows if wanted is None or r[0] in wanted]
        for name, overrides in rows:
            if time.time() > deadline:
                row = {"status": "skipped", "why": "no time left of the budget"}
            else:
                t0 = time.monotonic()
                try:
                    r = ours(args.config, overrides, ns, 0.0, doc_len=doc_len)
                    row = {"status": "ok", "tokens_per_s": r["tokens_per_s"], "step_ms": r["step_ms"],
                           "peak_gib": r.get("peak_mem_gib"), "last_loss": r["last_loss"]}
                except torch.OutOfMemoryError as exc:
                    row = {"status": "oom", "error": str(exc).splitlines()[0][:240]}
                row["try_s"] = time.monotonic() - t0
                _free(args.device)
            out.write(json.dumps(dict(row, seq_len=seq, doc_len=doc_len, row=name)) + "\n")
            out.flush()
