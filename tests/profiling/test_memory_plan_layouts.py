"""The memory planner's per-rank figures against what gloo ranks of a small layout really hold.

Static part, exact: each rank's parameter, gradient and optimizer-state bytes after a real
training step with ZeRO-1 at DP=2 (AdamW and Muon; EP=2; PP=2 x DP=2; bf16 weights and moments
where the trainer keeps them, skipped with the reason otherwise), summed over the ranks
that share a stage (Muon matrices go whole to an owner, so one rank's share is a balanced split,
not exactly 1/dp; AdamW's flat shards are padded to a multiple of dp, a few elements).

Activations, within 10%: the allocator's peak during one forward+backward on a rank, over the
bytes live before it. On CPU there is no ``torch.cuda.max_memory_allocated``; torch.profiler
with ``profile_memory=True`` records every allocation and free of the CPU allocator (``[memory]``
events with signed byte counts), and their running sum is the allocator's live bytes, the same
quantity max_memory_allocated follows on a GPU. Gradients are allocated by a first pass and kept
(accumulated into) in the measured one, so the increment is what the planner calls the peak
activations (saved tensors of the schedule's in-flight forwards, the recomputed layer, the
AttnRes block cache and the MoE dispatch buffers), plus the op transients the planner does not
count.
"""
from __future__ import annotations

import json

import pytest
import torch

from k3train.profiling.activation_bytes import records_bytes_per_token
from k3train.profiling.memory_plan import StateLayout, plan_memory
from k3train.runtime.distributed import init_distributed
from k3train.trainer.state import TrainState
from tests.helpers import allocator_peak, small_cfg
from tests.multiproc import run_multiprocess

B, T, M = 2, 32, 2      # micro-batch, tokens, microbatches


def _cfg(*extra):
    return small_cfg("train.device=cpu", f"train.micro_batch_size={B}", f"train.seq_len={T}",
                     f"train.microbatches={M}", "optim.zero1=true", "kernels.backend=torch", *extra)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (views of one buffer counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_tensors(opt):
    """Every tensor the optimizer keeps between steps (moments, momenta, shards; not scalars)."""
    out, stack = [], [opt.state_dict()]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def _measure_rank(rank, world_size, out_dir, overrides):
    cfg = _cfg(*overrides)
    p = cfg.parallel
    info = init_distributed(p.tp, p.pp, p.vpp, p.ep, "cpu")
    torch.manual_seed(0)
    state = TrainState(cfg, info, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    m = cfg.train.microbatches
    batch = lambda: torch.randint(0, cfg.model.vocab_size, (B * m, T + 1), generator=gen)  # noqa: E731
    state.train_step(batch())                        # the optimizer's state now exists
    params = _storage_bytes(state.model.parameters())
    optimizer = _storage_bytes(_optimizer_tensors(state.optimizer))
    state._forward_backward(batch())                 # allocates every gradient
    # fp32 gradients live in .grad, or in .main_grad where the weights are bf16
    grads = _storage_bytes(g for q in state.model.parameters() for g in (q.grad, getattr(q, "main_grad", None))
                           if g is not None)
    x = batch()
    peak, net = allocator_peak(lambda: state._forward_backward(x))   # gradients accumulate in place
    (out_dir / f"rank{rank}.json").write_text(json.dumps({
        "pp_rank": state.parallel.pp_rank, "params": params, "grads": grads, "optimizer": optimizer,
        "peak": peak, "net": net,
        "param_dtypes": sorted({str(q.dtype) for q in state.model.parameters()}),
        "state_dtypes": sorted({str(t.dtype) for t in _optimizer_tensors(state.optimizer) if t.is_floating_point()})}))


def _run(tmp_path, overrides, world):
    run_multiprocess(_measure_rank, world, tmp_path, overrides)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


LAYOUTS = [
    (["optim.name=adamw"], 2, 2),
    (["optim.name=muon"], 2, 2),
    (["optim.name=adamw", "parallel.ep=2"], 2, 2),
    (["optim.name=muon", "parallel.pp=2", "train.microbatches=2"], 4, 2),
]
BF16 = ["precision.param_dtype=bf16", "optim.state_dtype=bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, world, dp", [*LAYOUTS, (["optim.name=adamw", "parallel.ep=2", *BF16], 2, 2)],
                         ids=["dp2-adamw", "dp2-muon", "ep2-dp2-adamw", "pp2-dp2-muon", "ep2-dp2-adamw-bf16"])
def test_static_bytes_match_gloo_ranks_under_zero1(world1, tmp_path, overrides, world, dp):
    """Under bf16 weights the optimizer's state dict holds the fp32 main copy besides the
    moments, so the stage's ranks hold dp x (main copy + moments) of the planner's shares."""
    ranks = _run(tmp_path, overrides, world)
    cfg = _cfg(*overrides)
    state = StateLayout.of(cfg)
    if state.param_dtype == "bf16" and ranks[0]["param_dtypes"] != ["torch.bfloat16"]:
        pytest.skip(f"the trainer keeps {ranks[0]['param_dtypes']} weights under precision.param_dtype=bf16 "
                    "(bf16 weights with an fp32 main copy not in this tree yet)")
    if state.state_dtype == "bf16" and "torch.bfloat16" not in ranks[0]["state_dtypes"]:
        pytest.skip("the optimizer keeps no bf16 moments under optim.state_dtype=bf16 (not in this tree yet)")
    plans = plan_memory(cfg, ops="torch", act_bytes=4, dp=dp, state=state)
    for plan in plans:
        mine = [r for r in ranks if r["pp_rank"] == plan.pp_rank]
        assert len(mine) == dp
        for r in mine:
            assert r["params"] == plan.params, (plan.pp_rank, r["params"], plan.params)
            assert r["grads"] == plan.grads
        # The stage's dp ranks together hold the whole state once: dp x the planner's share,
        # up to AdamW's flat-buffer padding (< dp elements of 2 moments per buffer).
        held = sum(r["optimizer"] for r in mine)
        share = plan.optimizer_zero1 + plan.master_zero1
        assert abs(held - dp * share) <= 3 * 4 * dp * 8, (held, dp * share)
        assert plan.optimizer_zero1 == pytest.approx(plan.optimizer / dp, rel=1e-12) if "parallel.ep=2" not in overrides \
            else plan.optimizer_zero1 < plan.optimizer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "full"])
@pytest.mark.parametrize("overrides, world, dp", [LAYOUTS[0], LAYOUTS[2], LAYOUTS[3]],
                         ids=["dp2", "ep2-dp2", "pp2-dp2"])
def test_activation_peak_matches_the_allocator_within_10_percent(world1, tmp_path, overrides, world, dp, mode):
    ranks = _run(tmp_path, [*overrides, f"train.recompute={mode}"], world)
    cfg = _cfg(*overrides, f"train.recompute={mode}")
    plans = plan_memory(cfg, ops="torch", act_bytes=4, dp=dp)
    for plan in plans:
        predicted = plan.peak_activations[mode] + plan.attnres_cache + plan.moe_buffers + plan.routing_last
        for r in (r for r in ranks if r["pp_rank"] == plan.pp_rank):
            print(f"{mode} pp rank {plan.pp_rank}: planned {predicted:.0f} B, allocator peak {r['peak']} B, "
                  f"ratio {predicted / r['peak']:.3f}")
            # What the pass made was freed, up to frees of blocks made before the profile began,
            # which the profiler cannot size (it warns so; under EP a few dispatch buffers): a
            # net a few % above zero (up to 7.8% seen under EP, varying run to run), never below.
            assert 0 <= r["net"] < 0.10 * r["peak"], r
            assert predicted == pytest.approx(r["peak"], rel=0.10), (plan.pp_rank, predicted, r["peak"],
                                                                     predicted / r["peak"])


@pytest.mark.slow
def test_pipeline_peak_holds_every_microbatchs_routing_records(world1, tmp_path):
    """PP=2 x DP=2, 8 microbatches, 64 experts, full recompute, so that the routing records
    (scores [E] and int32 ids per token per MoE layer under the default quantile balancing, kept
    for every microbatch until the step ends) are a visible share of a rank's peak: the planner
    within 10% of each rank's allocator peak, and more than 5% under on the last rank if it
    counted only one microbatch's records (0.96 of the peak with them, 0.91 without, seen; the
    share was twice that while the records kept the whole routing, and the check 10%)."""
    m = 8
    overrides = ["optim.name=adamw", "parallel.pp=2", f"train.microbatches={m}", "moe.num_experts=64",
                 "train.recompute=full"]
    ranks = _run(tmp_path, overrides, 4)
    cfg = _cfg(*overrides)
    for plan in plan_memory(cfg, ops="torch", act_bytes=4, dp=2):
        predicted = plan.peak_activations["full"] + plan.attnres_cache + plan.moe_buffers + plan.routing_last
        one_mb = records_bytes_per_token(cfg, plan.layers, 4) * B * T
        for r in (r for r in ranks if r["pp_rank"] == plan.pp_rank):
            print(f"pp rank {plan.pp_rank}: planned {predicted:.0f} B, allocator peak {r['peak']} B, "
                  f"ratio {predicted / r['peak']:.3f}, one microbatch's records {one_mb:.0f} B")
            assert predicted == pytest.approx(r["peak"], rel=0.10), (plan.pp_rank, predicted, r["peak"])
            if plan.pp_rank == 1:
                assert predicted - (m - 1) * one_mb < 0.95 * r["peak"]


def test_allocator_peak_sees_a_known_allocation():
    """The measurement itself: a 1 MiB tensor made and freed inside shows as a 1 MiB peak."""
    def make():
        x = torch.empty(1 << 18, dtype=torch.float32)
        del x
    peak, net = allocator_peak(make)
    assert peak == 1 << 20 and net == 0
