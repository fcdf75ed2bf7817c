"""Context parallelism in the model: parallel.cp ranks against one process, gloo.

Model (fp64, 1e-10): each CP rank's ``K3Chunk`` (``use_context_parallel``: its KDA layers call
``kda_cp`` and ``short_conv_cp``, its MLA layers ``mla_attention_cp``) runs its contiguous slice
of every window; the cross-entropy summed over the rank's target tokens, divided by the window's
count, summed over the ranks, is compared with the one-process model of the same config (same
seed, same weights) on the whole windows, and so is every parameter gradient summed over the CP
group; the bytes each rank logged equal ``cp_bytes_per_rank`` per layer. The tiny model has KDA
and MLA layers, AttnRes blocks and MoE; the targets ignore most positions, unevenly across ranks.

Trainer (``TrainState`` at ``parallel.cp``, fp64 weights, under selective and full recompute):
the step's own slicing (``_cp_slice``), loss divisor and DP x CP gradient reduction against the
DP-only one-process step. The model's cross-entropy runs in fp32 (``logits.float()``), so this compares to fp32
rounding; the fp64 parity of the layers is the model test's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3train.config import load_config
from k3train.model.model import build_model
from k3train.ops.context_parallel import CPCommLog, cp_bytes_per_rank, cp_token_index
from k3train.runtime.distributed import init_distributed, parallel_context
from k3train.trainer.loop import train
from k3train.trainer.state import TrainState
from tests.helpers import SMALL, tiny_cfg
from tests.multiproc import run_multiprocess

TOL = dict(rtol=0, atol=1e-10)
FP32_CE = dict(rtol=1e-5, atol=1e-8)  # the model's loss is fp32 (logits.float())
SEQ, MB = 16, 2
BASE = ["model.dense_layers=1", "model.attnres.enabled=true", "model.attnres.block_size=2",
        "moe.balancing=quantile", f"train.seq_len={SEQ}",
        f"train.micro_batch_size={MB}", "train.microbatches=2"]


def _batch(replica: int, vocab: int, seq: int = SEQ) -> torch.Tensor:
    """Windows [MB * microbatches, seq + 1] of DP replica ``replica``."""
    gen = torch.Generator().manual_seed(50 + replica)
    return torch.randint(0, vocab, (2 * MB, seq + 1), generator=gen)


def _targets(windows: torch.Tensor) -> torch.Tensor:
    """Next tokens with most positions ignored (-100), more of them early in the window, so the
    CP ranks' slices hold different numbers of target tokens."""
    t = windows[:, 1:].clone()
    keep = torch.zeros_like(t, dtype=torch.bool)
    keep[:, 2::5] = True
    keep[:, t.shape[1] - 3:] = True
    t[~keep] = -100
    return t


# Document starts of the 4 windows of 16 (or 24) tokens (a boundary at every row start): at a
# rank boundary (8 at cp = 2; 4, 8, 12 at cp = 4; head-tail pieces: multiples of 4 at cp = 2 and
# of 3 at cp = 4 over 24 tokens), inside a chunk or piece, inside a conv halo (the 3 tokens before
# a boundary), and documents that cross boundaries (row 2: one document over every piece).
STARTS = [[0, 5, 8], [0, 3, 11], [0], [0, 4, 12, 13]]


def _documents(windows: torch.Tensor) -> torch.Tensor:
    """cu_seqlens [N+1] over the flattened B * SEQ inputs, the same STARTS in every batch."""
    B, seq = windows.shape[0], windows.shape[1] - 1
    bounds = [b * seq + s for b in range(B) for s in STARTS[b % len(STARTS)]] + [B * seq]
    return torch.tensor(bounds, dtype=torch.int32)


def _check_grads(rank, model, ref_model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ref = dict(ref_model.named_parameters())
    assert len(named) == len(ref) > 20
    for name, p in named:
        assert p.grad is not None and ref[name].grad is not None, name
        yield name, p.grad, ref[name].grad


def _model_body(rank, world, cp, documents, partition="contiguous"):
    seq = 24 if (partition, cp) == ("head_tail", 4) else SEQ  # pieces of 3: the conv's halo fits
    lengths = [f"train.seq_len={seq}"]
    cfg = tiny_cfg(*BASE, *lengths, f"parallel.cp={cp}", f"parallel.cp_partition={partition}")
    info = init_distributed(cp=cp)
    group = parallel_context(info).cp_group
    model = build_model(cfg).double()
    log = CPCommLog()
    model.use_context_parallel(group, log, partition)
    ref_model = build_model(tiny_cfg(*BASE, *lengths)).double()
    windows = _batch(0, cfg.model.vocab_size, seq)
    inputs, targets = windows[:, :-1], _targets(windows)
    seg = dict(segments=_documents(windows)) if documents else {}
    n = seq // cp
    mine = cp_token_index(seq, rank, cp, partition)
    count = (targets != -100).sum()
    local = F.cross_entropy(model(inputs[:, mine], **seg).flatten(0, 1), targets[:, mine].flatten(),
                            reduction="sum") / count
    local.backward()
    ref = F.cross_entropy(ref_model(inputs, **seg).flatten(0, 1), targets.flatten())
    ref.backward()
    loss = local.detach().clone()
    dist.all_reduce(loss, group=group)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    for name, got, want in _check_grads(rank, model, ref_model):
        dist.all_reduce(got, group=group)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")

    # Bytes per layer type against the formula (fp64 activations and states, one forward and
    # backward): 3 KDA layers and 1 MLA layer in the default K, K, K, M pattern of 4 layers.
    k, a = cfg.model.kda, cfg.model.mla
    per = cp_bytes_per_rank(cp=cp, rank=rank, batch=2 * MB, local_tokens=n, kda_heads=k.num_heads,
                            kda_head_dim=k.head_dim, conv_channels=k.num_heads * k.head_dim,
                            conv_width=k.conv_size, mla_latent_dim=a.kv_lora_rank + a.qk_rope_head_dim,
                            state_bytes=8, act_bytes=8, partition=partition)
    layers = {"kda": 3, "conv": 3 * 3, "mla": 1}  # three convs (q, k, v) per KDA layer
    for tag, count in layers.items():
        for d in ("fwd", "bwd"):
            # with documents KDA folds each row on its own: B folds of one row, the same bytes
            assert log.total(tag, d) == count * per[f"{tag}_{d}"], (tag, d, log.total(tag, d))


def _trainer_body(rank, world, cp, documents, recompute, partition="contiguous"):
    cfg = tiny_cfg(*BASE, f"parallel.cp={cp}", f"train.recompute={recompute}", f"parallel.cp_partition={partition}")
    info = init_distributed(cp=cp)
    assert (info.cp, info.dp) == (cp, world // cp)
    state = TrainState(cfg, info, torch.device("cpu"), targets=_targets,
                       documents=_documents if documents else None)
    state.model.double()
    assert state.cp_rank == rank % cp and state.parallel.dp_rank == rank // cp
    batches = [_batch(d, cfg.model.vocab_size) for d in range(info.dp)]
    loss = state._forward_backward(batches[state.parallel.dp_rank])
    dist.all_reduce(loss, group=state.loss_group)
    state.grads.reduce_grads()
    # DP alone, in one process: the mean over replicas of the mean over microbatches.
    ref_model = build_model(tiny_cfg(*BASE)).double()
    ref_loss = 0.0
    for b in batches:
        for mb in b.chunk(2):
            seg = dict(segments=_documents(mb)) if documents else {}
            part = ref_model(mb[:, :-1], _targets(mb), **seg) / (2 * info.dp)
            part.backward()
            ref_loss += part.item()
    torch.testing.assert_close(loss.item() / state.loss_ranks, ref_loss, **FP32_CE)
    for name, got, want in _check_grads(rank, state.model, ref_model):
        torch.testing.assert_close(got, want, **FP32_CE, msg=lambda m: f"rank {rank} {name}: {m}")
    # The step's cp/bytes_sent metric: with nothing recomputed, one forward and one backward of
    # every exchange per microbatch (2 microbatches), as the byte formula counts them; a second
    # call reports only what was sent since.
    metrics = state.cp_metrics()
    if recompute == "none":
        k, a = cfg.model.kda, cfg.model.mla
        per = cp_bytes_per_rank(cp=cp, rank=state.cp_rank, batch=MB, local_tokens=SEQ // cp,
                                kda_heads=k.num_heads, kda_head_dim=k.head_dim,
                                conv_channels=k.num_heads * k.head_dim, conv_width=k.conv_size,
                                mla_latent_dim=a.kv_lora_rank + a.qk_rope_head_dim, state_bytes=8, act_bytes=8,
                                partition=partition)
        one = sum(n * (per[f"{t}_fwd"] + per[f"{t}_bwd"]) for t, n in (("kda", 3), ("conv", 9), ("mla", 1)))
        assert metrics == {"cp/bytes_sent": 2 * one}, (metrics, 2 * one)
    assert metrics["cp/bytes_sent"] > 0 and state.cp_metrics() == {"cp/bytes_sent": 0}


@pytest.mark.slow
@pytest.mark.parametrize("cp, documents, partition", [
    (2, False, "contiguous"), (2, True, "contiguous"), (4, False, "contiguous"), (4, True, "contiguous"),
    (2, True, "head_tail"), (4, True, "head_tail")],
    ids=["2-windows", "2-documents", "4-windows", "4-documents", "2-documents-head_tail", "4-documents-head_tail"])
def test_cp_model_equals_the_whole_sequence(cp, documents, partition):
    """documents: the reference is the one-process model with the same boundaries
    (``segments``, document masking); documents start at rank boundaries and inside chunks,
    and some cross a boundary (their KDA state and conv halo pass over, their keys are seen).
    head_tail: each rank holds pieces r and 2P - 1 - r (KDA folds 2P pieces, each piece's halo
    comes from the piece before it, MLA attends at the pieces' global positions); the windows
    case is covered by the primitives' tests and the trainer step below."""
    run_multiprocess(_model_body, cp, cp, documents, partition)


@pytest.mark.slow
@pytest.mark.parametrize("world, cp, documents, recompute, partition", [
    (2, 2, True, "selective", "contiguous"), (4, 2, False, "full", "contiguous"), (2, 2, False, "none", "contiguous"),
    (2, 2, False, "none", "head_tail"), (2, 2, True, "full", "head_tail")],
    ids=["cp2-documents-selective", "dp2xcp2-full", "cp2-windows-none", "cp2-windows-none-head_tail",
         "cp2-documents-full-head_tail"])
def test_cp_training_step_equals_data_parallel(world, cp, documents, recompute, partition):
    """cp2: one replica over two ranks, document-masked windows; dp2xcp2: two DP replicas of two
    CP ranks each, in a world of four, against DP = 2 alone. Under recompute (the reference
    runs none) the CP exchanges run again in the recomputed forward, on every rank alike.
    head_tail: the trainer's own slicing (``_cp_slice``: each rank's two pieces, their targets
    the next global tokens), loss divisor and bytes under ``parallel.cp_partition=head_tail``."""
    run_multiprocess(_trainer_body, world, cp, documents, recompute, partition)


CLI_ARGS = [*SMALL, "train.log_interval=1"]


def _losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def _train(run_dir, *overrides: str, resume: bool = False) -> list[float]:
    """``k3train train`` on configs/k3_tiny.yaml (small) under torchrun, two CPU processes; the
    logged losses."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "k3train", "train", "--config", "configs/k3_tiny.yaml", "--run-dir", str(run_dir),
           *(["--resume"] if resume else []), *CLI_ARGS, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _losses(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_cp2_trains_and_resumes_as_cp1(tmp_path):
    """torchrun, two CPU processes, parallel.cp=2, document-masked windows (the default): 3 steps,
    a checkpoint (each dense piece written once, by CP rank 0), a resume to step 5; every logged loss equals the one-process run's to
    fp32 rounding (the ranks sum their shares of each window in another order). The one-process
    reference (the same schedule: 3 steps, then resumed to 5) runs in this process: ``k3train
    train`` calls the same ``train``, and a second interpreter would only add its start-up.
    The resume runs under ``parallel.cp_partition=head_tail``, the other partition (a checkpoint
    does not depend on it): steps 1-3 are contiguous, 4 and 5 head-tail steps of the CLI (a
    contiguous resume is the pipeline's and ZeRO-1's CLI tests')."""
    train(load_config("configs/k3_tiny.yaml", [*CLI_ARGS, "train.steps=3"]), tmp_path / "cp1")
    train(load_config("configs/k3_tiny.yaml", [*CLI_ARGS, "train.steps=5"]), tmp_path / "cp1", resume=True)
    one = _losses(tmp_path / "cp1")
    _train(tmp_path / "cp2", "parallel.cp=2", "train.steps=3")
    two = _train(tmp_path / "cp2", "parallel.cp=2", "parallel.cp_partition=head_tail", "train.steps=5",
                 resume=True)
    assert len(one) == len(two) == 5
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=2e-5, atol=0)
