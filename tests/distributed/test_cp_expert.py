"""Context parallelism composed with expert and tensor parallelism, ZeRO-1, distributed Muon
and every balancer, against the same global batch without CP.

Model (fp64, ``1e-10``): EP = 2 x CP = 2 and TP = 2 x CP = 2 with the aux balance loss and
documents across the CP boundary, each rank's loss as the trainer forms it (``cp`` x its share
of the cross-entropy, plus its share of the aux loss, ``moe.switch_aux_loss`` over the CP
group) and its gradients averaged over CP (expert shards gathered over EP, TP shards over TP),
against the one-process model on the whole windows: loss and every parameter gradient.

Trainer (fp32): each case runs ``TrainState.train_step`` (the trainer's own slicing, loss
divisor, gradient reduction, clipping, optimizer and balancer) for ``STEPS`` steps in gloo
processes, and the reference in one process at cp = ep = tp = 1 with the replicated optimizer,
on the same windows (a DP = 2 run's two replicas are one batch of twice the microbatches
there: the same mean loss, gradients and balancing tokens). megatron-core's linears hold fp32
weights, so the comparison is to fp32 rounding (the tolerances below say how much).
Compared: every step's loss and gradient norm, and after the last step every parameter
(expert shards gathered over EP, TP shards over TP) and every router bias. Documents start at
the CP boundary and inside chunks, and cross it (``STARTS``).

Each case would fail with a statistic taken over the wrong group: quantile balancing over DP
alone (the CP ranks' biases would differ from the reference's, which sees all tokens), the
aux loss on a rank's own slice (``f`` and ``P`` of half the tokens), expert gradients divided
by the DP size instead of DP x CP (they would be twice the reference's).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3train.errors import LayoutError
from k3train.model.model import build_model
from k3train.runtime.distributed import check_layout, init_distributed, parallel_context
from k3train.trainer.state import TrainState
from tests.distributed.helpers import cp_share_loss
from tests.helpers import tiny_cfg
from tests.multiproc import run_multiprocess

SEQ, MB, MICRO, STEPS = 16, 2, 2, 3
# Measured differences in fp32 (all cases): losses <= 2e-7 relative, gradient norms <= 1e-7 at
# step 1 and <= 5e-5 after two updates, parameters <= 4e-5 absolute, biases <= 2e-6. A
# statistic over the wrong group moves them by orders more: weights by the order of
# ``optim.lr`` (1e-2, AdamW and Muon normalise each update), biases by the order of themselves
# (5e-3), the step-1 gradient norm by the aux loss's or the experts' share of it.
TOL_LOSS = dict(rtol=2e-6, atol=0)
TOL_NORM1 = dict(rtol=1e-6, atol=0)  # step 1: same weights, fp32 rounding of the reductions
TOL_NORM = dict(rtol=3e-4, atol=0)  # later steps: after updates that amplify rounding (above)
TOL_P = dict(rtol=0, atol=3e-4)
TOL_BIAS = dict(rtol=0, atol=2e-5)
BASE = ["model.dense_layers=1", "model.attnres.enabled=true", "model.attnres.block_size=2",
        f"train.seq_len={SEQ}", f"train.micro_batch_size={MB}", f"train.microbatches={MICRO}",
        f"train.steps={STEPS}", "optim.warmup_steps=1", "optim.lr=1e-2"]
# Document starts of the windows of 16 tokens: at the CP boundary (8), inside a chunk, and
# documents that cross the boundary (3..11, 4..12).
STARTS = [[0, 5, 8], [0, 3, 11], [0], [0, 4, 12, 13]]


def _documents(windows: torch.Tensor) -> torch.Tensor:
    """cu_seqlens [N+1] over the flattened B * SEQ inputs of ``windows`` [B, SEQ + 1]."""
    B = windows.shape[0]
    bounds = [b * SEQ + s for b in range(B) for s in STARTS[b % len(STARTS)]] + [B * SEQ]
    return torch.tensor(bounds, dtype=torch.int32)


def _batch(step: int, replica: int, vocab: int) -> torch.Tensor:
    """Windows [MB * MICRO, SEQ + 1] of DP replica ``replica`` at ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randint(0, vocab, (MB * MICRO, SEQ + 1), generator=gen)


def _gathered(p: torch.Tensor, *, expert: bool, ep_group, tp_group, value: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The whole ``value`` (default: the parameter ``p`` itself; else e.g. its gradient):
    routed-expert shards concatenated over the EP group (in EP rank order, the experts' order),
    tensor-parallel shards over TP along the parameter's ``partition_dim``."""
    t = (p if value is None else value).detach().contiguous()
    if expert and ep_group is not None and dist.get_world_size(ep_group) > 1:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
        dist.all_gather(parts, t, group=ep_group)
        return torch.cat(parts)
    if getattr(p, "tensor_model_parallel", False) and dist.get_world_size(tp_group) > 1:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, t, group=tp_group)
        return torch.cat(parts, dim=p.partition_dim)
    return t.clone()


def _train(state: TrainState, batch_of) -> dict:
    """``STEPS`` steps on ``batch_of(step)``; the losses, gradient norms, whole parameters
    and router biases."""
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        state.schedule_lr(step)
        out = state.train_step(batch_of(step))
        assert out["finite"]
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    return {"losses": losses, "norms": norms,
            "params": {n: _gathered(p, expert=".experts." in n, ep_group=state.ep_group,
                                    tp_group=state.tp_group)
                       for n, p in state.model.named_parameters()},
            "biases": [layer.router.bias.clone() for layer in state.moe_layers]}


def _parallel(rank: int, world: int, overrides: list[str], cp: int, ep: int, tp: int, out) -> None:
    """The run under test: ``world`` ranks, ``world / (tp cp)`` DP replicas of ``tp x cp``
    ranks, each replica its own windows. Rank 0 saves the results and the sizes of the groups
    used."""
    cfg = tiny_cfg(*BASE, *overrides, f"parallel.cp={cp}", f"parallel.ep={ep}", f"parallel.tp={tp}")
    info = init_distributed(tp=tp, ep=ep, cp=cp)
    state = TrainState(cfg, info, torch.device("cpu"), documents=_documents)
    vocab = cfg.model.vocab_size
    got = _train(state, lambda step: _batch(step, state.parallel.dp_rank, vocab))
    got["groups"] = {"loss": dist.get_world_size(state.loss_group),
                     "expert_dp": dist.get_world_size(state.edp_group),
                     **{f"zero1-{d.name}": d.world for d in getattr(state.optimizer, "domains", [])}}
    # Every rank holds the same dense weights and biases (ZeRO-1 gathered them, the balancer
    # agreed): rank 0's are the run's.
    for t in [*got["biases"], *(p for n, p in got["params"].items() if ".experts." not in n)]:
        ref = t.clone()
        dist.broadcast(ref, src=0)
        assert torch.equal(t, ref)
    if rank == 0:
        torch.save(got, out)


def _reference(rank: int, world: int, overrides: list[str], dp: int, out) -> None:
    """One process, cp = ep = 1, replicated optimizer: the ``dp`` replicas' windows as one batch
    of ``dp`` times the microbatches (DP's mean loss, gradients and balancing tokens)."""
    ref = [o for o in overrides if o != "optim.zero1=true"]
    cfg = tiny_cfg(*BASE, *ref, f"train.microbatches={MICRO * dp}")
    state = TrainState(cfg, init_distributed(), torch.device("cpu"), documents=_documents)
    vocab = cfg.model.vocab_size
    torch.save(_train(state, lambda step: torch.cat([_batch(step, r, vocab) for r in range(dp)])), out)


CASES = {  # world, cp, ep, tp, overrides, the sizes of the groups the run must use
    # EP = CP = 2 in a world of two: the expert group is the CP group, each expert's tokens come
    # from both halves of every window; quantile balancing over both halves.
    "ep2xcp2-quantile": (2, 2, 2, 1, ["moe.balancing=quantile"], {"loss": 2, "expert_dp": 1}),
    # The balance loss's f and P over both halves of every window; under full recompute its
    # all-reduce runs again in each recomputed forward, on both ranks alike.
    "cp2-aux-loss-recompute": (2, 2, 1, 1, ["moe.balancing=aux_loss", "moe.aux_loss_coef=0.5",
                                            "train.recompute=full"],
                               {"loss": 2, "expert_dp": 2}),
    # Newton-Schulz owners over the two CP ranks (dense blocks; each expert shard has one
    # holder), aux-free balancing.
    "ep2xcp2-muon-distributed": (2, 2, 2, 1, ["optim.name=muon", "optim.muon_distributed=true",
                                              "moe.balancing=aux_free", "moe.aux_free_rate=0.01"],
                                 {"loss": 2, "expert_dp": 1}),
    # DP = 2 x CP = 2 with ZeRO-1: dense state sharded over all four ranks, expert state over
    # the expert-DP pairs (EP = 2 spans the CP ranks of a replica).
    "dp2xcp2-ep2-zero1": (4, 2, 2, 1, ["optim.zero1=true", "moe.balancing=quantile"],
                          {"loss": 4, "expert_dp": 2, "zero1-dense": 4, "zero1-expert": 2}),
    # EP = 4 spans CP x DP; ZeRO-1 with Muon.
    "dp2xcp2-ep4-zero1-muon": (4, 2, 4, 1, ["optim.zero1=true", "optim.name=muon"],
                               {"loss": 4, "expert_dp": 1, "zero1-dense": 4, "zero1-expert": 1}),
    # TP = 2 x CP = 2: heads split over TP inside each CP rank (the KDA fold per local head,
    # the MLA latent replicated over TP). AdamW: Muon at TP = 2 orthogonalises each rank's
    # shard, which differs from TP = 1 with or without CP.
    "tp2xcp2-adamw": (4, 2, 1, 2, ["optim.name=adamw", "moe.balancing=quantile"],
                      {"loss": 2, "expert_dp": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cp_training_equals_the_same_batch_without_cp(tmp_path, case):
    world, cp, ep, tp, overrides, groups = CASES[case]
    run_multiprocess(_reference, 1, overrides, world // (cp * tp), tmp_path / "ref.pt")
    run_multiprocess(_parallel, world, overrides, cp, ep, tp, tmp_path / "cp.pt")
    want, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "cp.pt")
    assert got["groups"] == groups
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL_LOSS)
    torch.testing.assert_close(got["norms"][0], want["norms"][0], **TOL_NORM1)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), **TOL_NORM)
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, **TOL_P, msg=lambda m: f"{name}: {m}")
    assert len(want["biases"]) == 3
    for b, ref in zip(got["biases"], want["biases"]):
        torch.testing.assert_close(b, ref, **TOL_BIAS)


def _model_body(rank: int, world: int, cp: int, ep: int, tp: int) -> None:
    base = [*BASE, "moe.balancing=aux_loss", "moe.aux_loss_coef=0.5", "train.microbatches=1"]
    cfg = tiny_cfg(*base, f"parallel.cp={cp}", f"parallel.ep={ep}", f"parallel.tp={tp}")
    ctx = parallel_context(init_distributed(tp=tp, ep=ep, cp=cp))
    model = build_model(cfg, ep_group=ctx.ep_group).double()
    model.use_context_parallel(ctx.cp_group)
    windows = _batch(0, 0, cfg.model.vocab_size)
    inputs, targets, seg = windows[:, :-1], windows[:, 1:], _documents(windows)
    # The aux loss rides on the layers' outputs (its gradient only), so the losses compare
    # without it.
    mean = cp_share_loss(model, inputs, targets, seg, cp=cp, cp_rank=ctx.cp_rank, cp_group=ctx.cp_group)
    grads = {}
    for name, p in model.named_parameters():
        # Dense weights: summed over their copies, the CP ranks. Experts: over theirs, the
        # expert-DP group (one rank at EP = CP); their tokens came through the all-to-all.
        expert = ".experts." in name
        grad = p.grad.clone()
        dist.all_reduce(grad, group=ctx.edp_group if expert else ctx.cp_group)
        grads[name] = _gathered(p, value=grad / cp, expert=expert, ep_group=ctx.ep_group, tp_group=ctx.tp_group)
    # The reference: the same seed at tp = cp = ep = 1 (megatron-core's groups rebuilt).
    init_distributed()
    ref_model = build_model(tiny_cfg(*base)).double()
    ref = F.cross_entropy(ref_model(inputs, segments=seg).flatten(0, 1), targets.flatten())
    ref.backward()
    torch.testing.assert_close(mean / cp, ref.detach(), rtol=0, atol=1e-10)
    routers = 0
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")
        routers += "router.weight" in name
    assert routers == 3 and len(grads) == len(dict(ref_model.named_parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("world, cp, ep, tp", [(2, 2, 2, 1), (4, 2, 1, 2)], ids=["ep2xcp2", "tp2xcp2"])
def test_cp_model_with_aux_loss_equals_the_whole_sequence(world, cp, ep, tp):
    """ep2xcp2: the expert group is the CP group (every expert gets tokens of both halves of
    every window); tp2xcp2: heads split over TP inside each CP rank. The aux loss on, documents
    across the CP boundary."""
    run_multiprocess(_model_body, world, cp, ep, tp)


def test_expert_parallel_may_span_context_parallel_ranks():
    """megatron-core's expert groups lie over DP x CP: ep = 4 fits two replicas of two CP
    ranks; ep = 3 fits no layout of four ranks, and the message names the size it must divide."""
    assert check_layout(4, 1, 1, 4, cp=2) == 2
    with pytest.raises(LayoutError, match=r"parallel.ep=3 must divide data- x tensor- x context-parallel size 4"):
        check_layout(4, 1, 1, 3, cp=2)
