"""Context parallelism composed with everything at once: pipeline x experts x CP in one run, and
the MX precision recipes under CP.

PP x EP x CP (trainer, fp32): PP = 2 x V = 2 x CP = 2 x EP = 2 is a world of four (dp = 1: the
expert group of a stage is its two CP ranks, ``check_layout`` lets EP span CP). Each case runs
``TrainState.train_step`` (the pipeline engine with the AttnRes block cache, each CP rank's
tokens hopping to the same CP rank of the next stage, the experts' all-to-all carrying both CP
ranks' tokens, quantile balancing over DP x CP or the switch aux loss over CP, gradients
reduced over DP x CP and the experts' over the expert-DP group) for ``STEPS`` steps, against one process at pp = cp = ep = 1 with the
same windows. The model is the tiny hybrid ``K M K M`` (one layer per chunk; the first dense,
the rest MoE; AttnRes blocks of two layers), windows of 16 tokens whose documents cross the CP
boundary (token 8), start on it and start inside the conv halo. Compared: every step's loss
and gradient norm, and after the last step every parameter (expert shards gathered over EP,
chunks over the pipeline stages) and every router bias.

MX recipes under CP (model, fp64): MX fake-quantisation scales each block of 32 elements along
a GEMM's reduction dimension, that is within one token's row of an activation (and within a
weight, the same on every rank), so a rank's slice of the sequence quantises exactly as it does
inside the whole sequence: CP changes only the order of fp ops upstream (the KDA fold, the
gathered MLA prefix), never which values are quantised together. In fp64 that makes CP = 2 equal
to CP = 1 under the same recipe to ``1e-10`` (loss and every gradient): an fp64 rounding
difference would have to land within 1e-16 of one of E4M3's or E2M1's rounding midpoints to
move a quantised value. A per-tensor or per-sequence scale would not commute with the split
(``test_mx_scales_commute_with_the_sequence_split`` shows the per-token property directly).

MX recipes in the trainer (fp32): the same holds up to fp32 rounding, and fp32 rounding can
flip a rounding decision. Once an update has run, the two runs' weights differ by fp32
rounding, and quantising them to E2M1/E4M3 can amplify that difference by orders of magnitude,
with no CP at all: at cp = 1, weights scaled by ``1 + 1e-7 N(0, 1)`` moved the parameters after three
steps by 1.5e-3 (mxfp4_qat) and 1.2e-3 (mxfp8), against 6.5e-5 in fp32. The PP x EP x CP run
moved them by up to 9e-3 under mxfp4_qat, depending on the windows. Adam's first steps are
close to sign steps, so a flipped decision moves a weight by the order of ``optim.lr``. So the
MX cases take one step from the same weights and are held to the fp32 tolerances: the step's
loss and gradient norm, and the parameters after its update (measured with ``CASES``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3train.errors import LayoutError
from k3train.model.model import build_model
from k3train.quant.mx import fake_quant_mx
from k3train.runtime.distributed import check_layout, init_distributed, parallel_context
from k3train.trainer.state import TrainState
from tests.distributed.helpers import cp_share_loss
from tests.helpers import tiny_cfg
from tests.multiproc import run_multiprocess

SEQ, MB, MICRO, STEPS, CP, PP, EP = 16, 2, 2, 3, 2, 2, 2  # STEPS: the fp32 cases' train.steps
BASE = ["model.layer_pattern=KM", "model.dense_layers=1", "model.attnres.enabled=true",
        "model.attnres.block_size=2", "model.tie_embeddings=false", "moe.balancing=quantile",
        f"train.seq_len={SEQ}", f"train.micro_batch_size={MB}", f"train.microbatches={MICRO}",
        f"train.steps={STEPS}", "optim.warmup_steps=1", "optim.lr=1e-2"]
LAYOUT = [f"parallel.pp={PP}", "parallel.vpp=2", f"parallel.cp={CP}", f"parallel.ep={EP}"]
# The MX recipes' expert GEMMs need reduction dims in blocks of 32; the scope adds the KDA
# q/k/v projections (their outputs feed the conv halo) and MLA's kv_down (its output is the
# latent every CP rank all-gathers) to the default routed experts.
MX = ["moe.latent_size=32", "moe.expert_ffn_size=32",
      r"precision.scope=['\.ffn\.experts$', '\.mixer\.(q|k|v)_proj$', '\.mixer\.kv_down$']"]
# Document starts of the windows; CP rank 1 holds tokens 8..15: a document crossing the
# boundary (5..15), one starting on it (8), one starting inside the previous rank's conv halo
# (7, among tokens 5..7) and one crossing it further in (4..12).
STARTS = [[0, 5], [0, 3, 8, 11], [0, 7], [0, 4, 13]]

# fp32 tolerances, as tests/distributed/test_cp_expert.py states them for the same model and
# optimizer (losses 2e-7 relative, step-1 gradient norms 1e-7, later norms and parameters
# amplified by the updates). Measured here: see CASES. A statistic over the wrong group, or a
# hop to the wrong CP rank, moves weights by the order of optim.lr (1e-2).
TOL_LOSS = dict(rtol=2e-6, atol=0)
TOL_NORM1 = dict(rtol=1e-6, atol=0)
TOL_NORM = dict(rtol=3e-4, atol=0)
TOL_P = dict(rtol=0, atol=3e-4)
TOL_BIAS = dict(rtol=0, atol=2e-5)


def _documents(windows: torch.Tensor) -> torch.Tensor:
    """cu_seqlens ``[N+1]`` over the flattened ``B * SEQ`` inputs of ``windows`` [B, SEQ + 1]."""
    B = windows.shape[0]
    bounds = [b * SEQ + s for b in range(B) for s in STARTS[b % len(STARTS)]] + [B * SEQ]
    return torch.tensor(bounds, dtype=torch.int32)


def _batch(step: int, vocab: int) -> torch.Tensor:
    """The step's windows ``[MB * MICRO, SEQ + 1]``, the same on every rank (dp = 1)."""
    return torch.randint(0, vocab, (MB * MICRO, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _global_name(chunk, name: str) -> str:
    """A chunk's parameter or buffer name in the one-process model (layers numbered from 0)."""
    if name.startswith("layers."):
        _, j, rest = name.split(".", 2)
        return f"layers.{chunk.layer_range[0] + int(j)}.{rest}"
    return name


def _ep_gathered(t: torch.Tensor, ep_group) -> torch.Tensor:
    """Routed-expert shards ``[E / ep, ...]`` concatenated over EP (EP rank order is the
    experts' order)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, t.detach().contiguous(), group=ep_group)
    return torch.cat(parts)


def _train(state: TrainState, vocab: int) -> tuple[list, list]:
    losses, norms = [], []
    for step in range(1, state.cfg.train.steps + 1):
        state.schedule_lr(step)
        out = state.train_step(_batch(step, vocab))
        assert out["finite"]
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    return losses, norms


def _weights(chunks, ep_group) -> dict[str, torch.Tensor]:
    """Every parameter and router bias of ``chunks`` under its global name, experts gathered."""
    out = {}
    for chunk in chunks:
        for n, p in chunk.named_parameters():
            whole = _ep_gathered(p, ep_group) if ep_group is not None and ".experts." in n else p.detach()
            out[_global_name(chunk, n)] = whole.clone()
        for n, b in chunk.named_buffers():
            if n.endswith("router.bias"):
                out[_global_name(chunk, n)] = b.clone()
    return out


def _parallel(rank: int, world: int, overrides: list[str], out) -> None:
    """PP x V x CP x EP on four ranks; rank 0 saves the losses, norms and the whole model."""
    cfg = tiny_cfg(*BASE, *overrides, *LAYOUT)
    info = init_distributed(pp=PP, vpp=2, cp=CP, ep=EP)
    state = TrainState(cfg, info, torch.device("cpu"), documents=_documents)
    ctx = state.parallel
    # megatron-core's order tp-cp-ep-dp-pp: a stage's two CP ranks are consecutive and are its
    # expert group; a pipeline group pairs the same CP rank of both stages.
    assert (ctx.cp_rank, ctx.pp_rank, info.dp) == (rank % CP, rank // CP, 1)
    assert dist.get_process_group_ranks(ctx.ep_group) == dist.get_process_group_ranks(ctx.cp_group)
    assert dist.get_process_group_ranks(ctx.pp_group) == [rank % CP, rank % CP + CP]
    losses, norms = _train(state, cfg.model.vocab_size)
    mine = _weights(state.model.values(), state.ep_group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        whole: dict[str, torch.Tensor] = {}
        for part in everyone:
            for name, t in part.items():
                # The CP ranks of a stage hold the same weights (dense: one update of the
                # DP x CP mean gradient; experts: the gathered shards).
                if name in whole:
                    assert torch.equal(whole[name], t), name
                whole[name] = t
        torch.save({"losses": losses, "norms": norms, "weights": whole}, out)


def _reference(rank: int, world: int, overrides: list[str], out) -> None:
    """One process, pp = cp = ep = 1, the same windows."""
    cfg = tiny_cfg(*BASE, *overrides)
    state = TrainState(cfg, init_distributed(), torch.device("cpu"), documents=_documents)
    losses, norms = _train(state, cfg.model.vocab_size)
    torch.save({"losses": losses, "norms": norms, "weights": _weights([state.model], None)}, out)


CASES = {
    # fp32 math, three steps. Measured: losses <= 1e-7 relative, gradient norms <= 2e-7,
    # parameters <= 8e-6 absolute, router biases <= 2e-7 (with two other seeds of the windows:
    # norms <= 1e-6, parameters <= 4.2e-5).
    "fp32": [],
    # Every chunk recomputed in backward: the CP exchanges and the experts' all-to-all run again
    # inside the same op of the same schedule on all ranks of a stage. Measured: as "fp32".
    "recompute-full": ["train.recompute=full"],
    # The switch balance loss of each MoE layer over both CP ranks' tokens (its counts
    # all-reduced over the CP group inside the pipeline schedule); no router biases move.
    # Measured: as "fp32".
    "aux-loss": ["moe.balancing=aux_loss", "moe.aux_loss_coef=0.5"],
    # The MX recipes: one step, from the same weights (why one: the module docstring).
    # Measured (three seeds of the windows): losses <= 1e-7 relative, norms <= 1.1e-7,
    # parameters <= 9e-5 (Adam's first update is nearly lr x sign(g): an element whose
    # gradient is near Adam's eps moves by lr times its gradient's rounding, relative).
    # MXFP4 weights / MXFP8 activations on the experts, KDA q/k/v and MLA kv_down.
    "mxfp4-qat": ["precision.recipe=mxfp4_qat", *MX, "train.steps=1"],
    # E4M3 weights and activations, recomputed: the recomputed forward quantises the same values.
    "mxfp8-recompute-full": ["precision.recipe=mxfp8", *MX, "train.recompute=full", "train.steps=1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pp_ep_cp_training_equals_one_process(tmp_path, case):
    """PP = 2 x V = 2 x CP = 2 x EP = 2 (four gloo ranks) trains as one process does."""
    run_multiprocess(_reference, 1, CASES[case], tmp_path / "ref.pt")
    run_multiprocess(_parallel, PP * CP, CASES[case], tmp_path / "par.pt")
    want, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "par.pt")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL_LOSS)
    torch.testing.assert_close(got["norms"][0], want["norms"][0], **TOL_NORM1)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), **TOL_NORM)
    assert got["weights"].keys() == want["weights"].keys()
    biases = [n for n in want["weights"] if n.endswith("router.bias")]
    assert len(biases) == 3
    for name, w in want["weights"].items():
        tol = TOL_BIAS if name in biases else TOL_P
        torch.testing.assert_close(got["weights"][name], w, **tol, msg=lambda m: f"{name}: {m}")


def _mx_body(rank: int, world: int) -> None:
    """CP = 2 x EP = 2 (a world of two), fp64: for each MX recipe, this rank's share of the loss
    and its gradients averaged over CP against the whole sequence in one process, same recipe."""
    windows = _batch(0, tiny_cfg().model.vocab_size)
    inputs, targets, seg = windows[:, :-1], windows[:, 1:], _documents(windows)
    results = {}
    for recipe in ("mxfp8", "mxfp4_qat", "fp32"):
        cfg = tiny_cfg(*BASE, *MX, f"precision.recipe={recipe}", f"parallel.cp={CP}", f"parallel.ep={EP}")
        ctx = parallel_context(init_distributed(ep=EP, cp=CP))
        model = build_model(cfg, ep_group=ctx.ep_group).double()
        model.use_context_parallel(ctx.cp_group)
        mean = cp_share_loss(model, inputs, targets, seg, cp=CP, cp_rank=ctx.cp_rank, cp_group=ctx.cp_group)
        grads = {}
        for name, p in model.named_parameters():
            # Dense weights: summed over their copies, the CP ranks; experts: one holder each
            # (the expert group is the CP group), their tokens from both CP ranks.
            grad = p.grad.clone()
            if ".experts." in name:
                grad = _ep_gathered(grad, ctx.ep_group)
            else:
                dist.all_reduce(grad, group=ctx.cp_group)
            grads[name] = grad / CP
        # The reference: the same seed at cp = ep = 1 (megatron-core's groups rebuilt), the
        # same recipe, the whole windows.
        init_distributed()
        ref_model = build_model(tiny_cfg(*BASE, *MX, f"precision.recipe={recipe}")).double()
        ref = F.cross_entropy(ref_model(inputs, segments=seg).flatten(0, 1), targets.flatten())
        ref.backward()
        torch.testing.assert_close(mean / CP, ref.detach(), rtol=0, atol=1e-10)
        assert grads.keys() == dict(ref_model.named_parameters()).keys()
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-10, msg=lambda m: f"{recipe} {name}: {m}")
        results[recipe] = ref.item()
    # The recipes did quantise: each moves the loss away from the unquantised model's.
    for recipe in ("mxfp8", "mxfp4_qat"):
        assert abs(results[recipe] - results["fp32"]) > 1e-4, results


@pytest.mark.slow
def test_mx_recipes_under_cp_equal_the_same_recipe_at_cp1():
    """MXFP8 and MXFP4-QAT (emulated) at CP = 2 x EP = 2 against the whole sequence with the
    same recipe: loss and every gradient to 1e-10 (fp64), documents across the CP boundary."""
    run_multiprocess(_mx_body, CP)


@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
def test_mx_scales_commute_with_the_sequence_split(elem):
    """MX blocks lie along the hidden (reduction) dim, one token's row each: quantising a CP
    rank's tokens gives bitwise the rows of the whole sequence's quantisation. Values spread
    over several binades per block so that the blocks' E8M0 scales differ."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, SEQ, 64, generator=gen) * torch.exp2(torch.randint(-6, 6, (2, SEQ, 1), generator=gen))
    whole = fake_quant_mx(x, elem, 32)
    assert not torch.equal(whole, x)
    for r in range(CP):
        part = slice(r * SEQ // CP, (r + 1) * SEQ // CP)
        assert torch.equal(fake_quant_mx(x[:, part], elem, 32), whole[:, part])


def test_pp_ep_cp_layout_fits_four_ranks():
    """PP = 2 x CP = 2 x EP = 2 needs no DP: each stage's expert group is its CP ranks. EP = 4
    would need two stages' worth of ranks in one expert group: refused, naming the size."""
    assert check_layout(4, 1, PP, EP, vpp=2, cp=CP) == 1
    with pytest.raises(LayoutError, match=r"parallel.ep=4 must divide data- x tensor- x context-parallel "
                                          r"size 2 \(world 4 / pp 2\)"):
        check_layout(4, 1, PP, 4, vpp=2, cp=CP)
