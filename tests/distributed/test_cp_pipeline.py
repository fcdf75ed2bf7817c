"""Context parallelism composed with the interleaved pipeline: PP=2 x V=2 x CP=2 (four gloo
ranks) against the whole model in one process.

The trainer's own path runs: ``TrainState`` builds the chunks (``build_parts``: every chunk's
mixers on the CP group, the hops to the same CP rank of the next stage), slices every window
(``engine_microbatch``: ``seq_len / cp`` tokens, the whole windows' document boundaries, the
loss divisor the engine hands to the last chunk), and reduces the gradients over DP x CP. The
model is the tiny hybrid, four layers ``K M K M`` (one per chunk: pipeline stage 0 holds the
KDA layers, stage 1 the MLA ones), the first dense and the rest MoE, AttnRes blocks of two
layers (block 0, the embedding, crosses hop 0 and chunk 3 reads it from stage 1's block
cache). Windows of 16 tokens with documents that cross the CP boundary (token 8), start on
it, start inside the conv halo, and most targets ignored, unevenly between the two CP slices.

Exactness (fp64 weights and activations): the model's own cross-entropy runs in fp32
(``logits.float()``), so the last chunk's loss is replaced by the same sum in fp64 over the
loss divisor the engine passes (``loss_tokens``); then the loss of every microbatch and every
parameter gradient equal the one-process run's to ``1e-10``, under recompute none, selective
and full; the step's returned loss (cast to fp32 by the engine) and the validation loss to
fp32 rounding. A negative control runs the same step with pipeline groups that pair CP rank 0
of one stage with CP rank 1 of the other (the wrong tokens' activations and blocks arrive):
its loss must differ. The CLI test runs the whole trainer (its resume under torchrun; fp32, ``2e-5``).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3train.config import load_config
from k3train.errors import ConfigError, LayoutError
from k3train.model.model import K3Chunk, build_model, produced_blocks
from k3train.ops.context_parallel import cp_bytes_per_rank
from k3train.profiling.predict import layout_messages
from k3train.runtime.distributed import init_distributed
from k3train.trainer.parts import _check_cp_pairing
from k3train.trainer.loop import train
from k3train.trainer.state import TrainState
from pipeline import PipelineEngine, PipelineLayout
from tests.helpers import SMALL, read_records, tiny_cfg
from tests.multiproc import run_multiprocess

TOL = dict(rtol=0, atol=1e-10)
FP32 = dict(rtol=1e-6, atol=1e-7)  # what the engine returns: the mean loss cast to fp32
SEQ, MB, M, CP, PP = 16, 2, 2, 2, 2
BASE = ["model.layer_pattern=KM", "model.dense_layers=1", "model.attnres.enabled=true",
        "model.attnres.block_size=2", "model.tie_embeddings=false", "moe.balancing=quantile",
        f"train.seq_len={SEQ}", f"train.micro_batch_size={MB}", f"train.microbatches={M}"]
LAYOUT = [f"parallel.cp={CP}", f"parallel.pp={PP}", "parallel.vpp=2"]

# Document starts of the windows (a boundary at every row start); CP rank 1 holds tokens 8..15:
# a document crossing the boundary (5..15), one starting on it (8), one starting inside the
# previous rank's conv halo (7, among tokens 5..7) and one crossing it further in (4..12).
STARTS = [[0, 5], [0, 3, 8, 11], [0, 7], [0, 4, 13]]


def _batch(vocab: int) -> torch.Tensor:
    """The step's windows ``[MB * M, SEQ + 1]``, the same on every rank."""
    return torch.randint(0, vocab, (MB * M, SEQ + 1), generator=torch.Generator().manual_seed(7))


def _targets(windows: torch.Tensor) -> torch.Tensor:
    """Next tokens with most positions ignored (-100), more of them in the first half, so the
    two CP slices hold different numbers of targets (the loss divisor must be the window's)."""
    t = windows[:, 1:].clone()
    keep = torch.zeros_like(t, dtype=torch.bool)
    keep[:, 1::5] = True
    keep[:, SEQ - 4:] = True
    t[~keep] = -100
    return t


def _documents(windows: torch.Tensor) -> torch.Tensor:
    """cu_seqlens ``[N+1]`` over the flattened ``B * SEQ`` inputs of ``windows``."""
    B = windows.shape[0]
    bounds = [b * SEQ + s for b in range(B) for s in STARTS[b % len(STARTS)]] + [B * SEQ]
    return torch.tensor(bounds, dtype=torch.int32)


def _fp64_loss(chunk, losses: list):
    """Replace the last chunk's fp32 cross-entropy by the same sum in fp64 over the divisor the
    engine passes; each microbatch's loss is appended to ``losses``."""
    logits_of = chunk.forward

    def forward(io, targets, loss_tokens):
        logits = logits_of(io)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / loss_tokens
        losses.append(loss.detach())
        return loss

    chunk.forward = forward


def _reference(cfg, batch):
    """The one-process model on the whole windows: per-microbatch fp64 losses (the gradient of
    their mean accumulated in the model) and the model."""
    model = build_model(cfg).double()
    losses = []
    for mb in batch.chunk(M):
        logits = model(mb[:, :-1], segments=_documents(mb))
        loss = F.cross_entropy(logits.flatten(0, 1), _targets(mb).flatten())
        (loss / M).backward()
        losses.append(loss.detach())
    return losses, model


def _global_name(chunk, name: str) -> str:
    """A chunk parameter's name in the one-process model (its layers are numbered from 0)."""
    if name.startswith("layers."):
        _, j, rest = name.split(".", 2)
        return f"layers.{chunk.layer_range[0] + int(j)}.{rest}"
    return name


def _grads(state) -> dict[str, torch.Tensor]:
    return {_global_name(chunk, n): p.grad for chunk in state.model.values()
            for n, p in chunk.named_parameters() if p.requires_grad}


def _step(state, batch, losses: list) -> torch.Tensor:
    """One forward/backward through the trainer's path; the step's loss averaged over DP x CP.
    ``losses`` (the last chunk's record, ``_fp64_loss``) then holds this step's only."""
    losses.clear()
    state.optimizer.zero_grad(set_to_none=True)
    total = state._forward_backward(batch)
    dist.all_reduce(total, group=state.loss_group)
    return total / state.loss_ranks


def _body(rank, world, recompute):
    cfg = tiny_cfg(*BASE, *LAYOUT, f"train.recompute={recompute}")
    info = init_distributed(pp=PP, vpp=2, cp=CP)
    state = TrainState(cfg, info, torch.device("cpu"), targets=_targets, documents=_documents)
    state.model.double()
    ctx = state.parallel
    # megatron-core's order tp-cp-ep-dp-pp: the CP ranks of a stage are consecutive, and a
    # pipeline group pairs the stages' ranks of one CP index.
    assert (ctx.cp_rank, ctx.pp_rank) == (rank % CP, rank // CP)
    assert dist.get_process_group_ranks(ctx.pp_group) == [rank % CP, rank % CP + CP]
    batch = _batch(cfg.model.vocab_size)
    ref_losses, ref_model = _reference(tiny_cfg(*BASE), batch)
    ref_grads = dict(ref_model.named_parameters())
    losses: list = []
    if state.engine.C - 1 in state.engine.chunks:
        _fp64_loss(state.engine.chunks[state.engine.C - 1], losses)

    total = _step(state, batch, losses)
    state.grads.reduce_grads()     # the mean over DP x CP, as a training step takes it
    torch.testing.assert_close(total.double(), torch.stack(ref_losses).mean(), **FP32)
    if ctx.pp_rank == PP - 1:      # each CP rank's loss is cp x its share of the window's
        shares = torch.stack(losses)
        dist.all_reduce(shares, group=ctx.cp_group)
        torch.testing.assert_close(shares / CP, torch.stack(ref_losses), **TOL)
    grads = _grads(state)
    for name, got in grads.items():
        assert got is not None, name
        torch.testing.assert_close(got, ref_grads[name].grad, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
    # The two stages together hold every parameter of the model, each once per CP rank.
    everyone: list = [None] * world
    dist.all_gather_object(everyone, sorted(grads))
    assert sorted(everyone[rank % CP] + everyone[rank % CP + CP]) == sorted(ref_grads)
    # Validation through the engine: the CP ranks' shares of each window summed.
    assert state.evaluate(list(batch.chunk(M))) == pytest.approx(torch.stack(ref_losses).mean().item(),
                                                                 rel=1e-6)

    # The CP bytes of the step (cp/bytes_sent): per microbatch one forward and one backward of
    # each exchange of this stage's layers, K and K on stage 0, M and M on stage 1.
    metrics = state.cp_metrics()
    if recompute == "none":
        k, a = cfg.model.kda, cfg.model.mla
        per = cp_bytes_per_rank(cp=CP, rank=ctx.cp_rank, batch=MB, local_tokens=SEQ // CP,
                                kda_heads=k.num_heads, kda_head_dim=k.head_dim,
                                conv_channels=k.num_heads * k.head_dim, conv_width=k.conv_size,
                                mla_latent_dim=a.kv_lora_rank + a.qk_rope_head_dim, state_bytes=8, act_bytes=8)
        layers = (("kda", 2), ("conv", 6)) if ctx.pp_rank == 0 else (("mla", 2),)
        one = sum(n * (per[f"{t}_fwd"] + per[f"{t}_bwd"]) for t, n in layers)
        # two training microbatches, then the validation forward of two
        fwd = sum(n * per[f"{t}_fwd"] for t, n in layers)
        assert metrics == {"cp/bytes_sent": M * one + M * fwd}, (metrics, M * one + M * fwd)
    assert metrics["cp/bytes_sent"] > 0

    # Negative control: pipeline groups that cross CP ranks ({0, 3} and {1, 2}) are refused by
    # the build-time check, and an engine run on them anyway hands stage 1 the other CP
    # rank's tokens: the loss changes.
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    mine = crossed[0] if rank in (0, 3) else crossed[1]
    with pytest.raises(LayoutError, match="pairs context-parallel ranks"):
        _check_cp_pairing(dataclasses.replace(ctx, pp_group=mine))
    layout = PipelineLayout(cfg.model.num_layers, PP, 2)
    ranges = [(r.start, r.stop) for r in map(layout.layer_range, range(layout.num_chunks))]
    state.engine = PipelineEngine(local_chunks={int(c): m for c, m in state.model.items()},
                                  num_chunks=layout.num_chunks, produced_blocks=produced_blocks(cfg, ranges),
                                  pp_group=mine)
    total = _step(state, batch, losses)
    assert not torch.allclose(total.double(), torch.stack(ref_losses).mean(), rtol=1e-3, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_cp_pipeline_step_equals_one_process(recompute):
    """PP=2 x V=2 x CP=2 in four processes: loss and every gradient to 1e-10 (fp64)."""
    run_multiprocess(_body, PP * CP, recompute)


CLI_ARGS = [*SMALL, "model.num_layers=4", "train.microbatches=2", "train.log_interval=1"]


def _train(run_dir, *overrides: str, resume: bool = False) -> None:
    """``k3train train`` on configs/k3_tiny.yaml (small, four layers) under torchrun, four CPU
    processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(PP * CP),
           "-m", "k3train", "train", "--config", "configs/k3_tiny.yaml", "--run-dir", str(run_dir),
           *(["--resume"] if resume else []), *CLI_ARGS, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _train_rank(rank, world, run_dir, overrides):
    train(load_config("configs/k3_tiny.yaml", [*CLI_ARGS, *overrides]), run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_pp2_vpp2_cp2_trains_and_resumes_as_one_process(tmp_path):
    """torchrun, four CPU processes, pp=2 x vpp=2 x cp=2 on document-masked windows (the
    default): 3 steps and a checkpoint on four gloo ranks (run_multiprocess: the same ``train``
    that ``k3train train`` calls, without four interpreters' start-up), then ``k3train train
    --resume`` under torchrun to step 5 (validation at steps 3 and 5, the end-of-run plots on the
    slices); every logged loss and validation loss equals the one-process run's to fp32 rounding
    (the ranks sum their shares in another order). The one-process reference (the same config,
    3 steps and a resume to 5) runs in this process. A fresh start under torchrun with CP is
    test_cp_model.py's CLI test."""
    train(load_config("configs/k3_tiny.yaml", [*CLI_ARGS, "train.steps=3"]), tmp_path / "one")
    train(load_config("configs/k3_tiny.yaml", [*CLI_ARGS, "train.steps=5"]), tmp_path / "one", resume=True)
    run_multiprocess(_train_rank, PP * CP, tmp_path / "pp-cp", [*LAYOUT, "train.steps=3"])
    _train(tmp_path / "pp-cp", *LAYOUT, "train.steps=5", "train.plots=true", resume=True)
    one, got = (read_records(tmp_path / run) for run in ("one", "pp-cp"))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for key in ("loss", "val_loss"):
        want = [r[key] for r in one if key in r]
        assert len(want) >= 2 and [r[key] for r in got if key in r] == pytest.approx(want, rel=2e-5), key
    assert (tmp_path / "pp-cp" / "attnres_depth.png").read_bytes()[:4] == b"\x89PNG"


def test_cp_pipeline_layouts_load_and_cuda_graphs_are_refused():
    """PP x CP (any vpp) loads; what CP still cannot serve under it is refused in one line."""
    cfg = load_config(None, [*LAYOUT, "train.microbatches=2", "train.seq_len=64"])
    assert (cfg.parallel.cp, cfg.parallel.pp, cfg.parallel.vpp) == (CP, PP, 2)
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LAYOUT, "train.microbatches=2", "train.seq_len=64", "train.cuda_graph=true"])
    message = str(err.value)
    assert "\n" not in message
    assert "parallel.cp=2 with train.cuda_graph=true: not wired yet" in message
    assert "use parallel.cp=1" in message


def test_predicted_hop_messages_carry_one_cp_slice():
    """The pipeline predictor's hop messages are one CP rank's tokens, as the engine sends them:
    every message of cp = 2 is half the cp = 1 one (hidden and blocks ``[B, seq_len / cp, D]``)."""
    whole, sliced = (layout_messages(tiny_cfg(*BASE, f"parallel.pp={PP}", "parallel.vpp=2", f"parallel.cp={cp}"),
                                     PP, 2) for cp in (1, CP))
    assert len(whole) == len(sliced) > 0 and all(m.nbytes > 0 for m in whole)
    assert [(m.nbytes, m.tensors) for m in sliced] == [(m.nbytes // CP, m.tensors) for m in whole]


@pytest.mark.parametrize("num_chunks", [1, 2])
def test_engine_hands_the_loss_divisor_to_the_last_chunk(num_chunks, world1):
    """One process, the engine over 1 chunk (first and last) or 2 (local hand-over): with a
    fourth microbatch element the last chunk returns its summed token losses over that divisor,
    as the whole model does with ``loss_tokens=``; the gradients follow (fp64, 1e-12)."""
    cfg = tiny_cfg(*BASE)
    layout = PipelineLayout(cfg.model.num_layers, 1, num_chunks)
    ranges = [(r.start, r.stop) for r in map(layout.layer_range, range(num_chunks))]
    chunks = {c: K3Chunk(cfg, *ranges[c], first=c == 0, last=c == num_chunks - 1).double()
              for c in range(num_chunks)}
    engine = PipelineEngine(local_chunks=chunks, num_chunks=num_chunks,
                            produced_blocks=produced_blocks(cfg, ranges))
    ref = build_model(cfg).double()
    batch = _batch(cfg.model.vocab_size)
    mbs = [(mb[:, :-1], _targets(mb), _documents(mb), torch.tensor(3.5, dtype=torch.float64))
           for mb in batch.chunk(M)]
    loss = engine.train_step(mbs)
    want = sum(ref(x, t, segments=s, loss_tokens=d) for x, t, s, d in mbs) / M
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)   # the engine returns fp32
    got = {_global_name(ch, n): p.grad for ch in chunks.values() for n, p in ch.named_parameters()}
    assert got.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")
